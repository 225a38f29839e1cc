"""The step-time estimate: bytes and launches read from a compiled module's HLO, and the
estimate on the H100 target (its constants fitted by benchmarks/step_time.py)."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jmem
from jmem import measure, train
from jmem.measure import _step_time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An optimised module's text as XLA:GPU prints it: a fusion, a cuDNN call with a tuple
# result, views and a copy; the fused computation's own instructions are not kernels.
_HLO = """HloModule m, entry_computation_layout={(f32[4]{0}, bf16[2,3]{1,0})->(f32[4]{0})}

%fused_negate (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

ENTRY %main (x: f32[4], w: bf16[2,3]) -> (f32[4], bf16[6]) {
  %x = f32[4]{0} parameter(0)
  %w = bf16[2,3]{1,0} parameter(1)
  %fusion = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_negate, metadata={op_name="a(b)"}
  %cc = (bf16[2,3]{1,0}, u8[16]{0}) custom-call(%w, %fusion), custom_call_target="__cudnn$convForward"
  %gte = bf16[2,3]{1,0} get-tuple-element(%cc), index=0
  %b = bf16[6]{0} bitcast(%gte)
  %c = bf16[6]{0} copy(%b)
  ROOT %t = (f32[4]{0}, bf16[6]{0}) tuple(%fusion, %c)
}
"""


def test_traffic_counts_operand_and_result_bytes_of_each_kernel_of_the_entry():
  t = measure.traffic(_HLO)
  # fusion 16 + 16; custom call (12 + 16) + (12 + 16); copy 12 + 12.
  assert t.bytes == 32 + 56 + 24
  assert (t.kernels, t.library_calls, t.loops) == (3, 1, 0)
  assert t.by_opcode == {"fusion": 32, "custom-call": 56, "copy": 24}
  assert t.library_dtype == "bf16"
  assert measure.shape_bytes("(f32[2,3]{1,0}, s4[5], pred[])") == 24 + 3 + 1


def test_traffic_refuses_text_that_is_no_module():
  with pytest.raises(ValueError, match="ENTRY"):
    measure.traffic("f32[4] add(x, y)")


class _CNN(nn.Module):

  @nn.compact
  def __call__(self, x, train=True):
    for width in (16, 32):
      x = nn.relu(nn.Conv(width, (3, 3))(nn.relu(nn.Conv(width, (3, 3))(x))))
    return nn.Dense(10)(x.mean((1, 2)))


def _estimate(model):
  h100 = measure.target("h100")
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  x = jax.ShapeDtypeStruct((8, 16, 16, 3), jnp.float32)
  step = train.make_train_step(fns, opt)
  lowered = h100.lower(step, train.abstract_state(fns, opt, x), x,
                       jax.ShapeDtypeStruct((8,), jnp.int32))
  return measure.estimate_step_time(h100.compile_lowered(lowered),
                                    measure.lowered_flops(lowered))


def test_the_estimate_charges_what_remat_and_actnn_add_on_the_h100_target():
  """Remat recomputes (here only the ReLUs: more launches, no more FLOPs); ActNN quantizes
  (more launches): each is estimated slower than exact, and the three terms add up."""
  exact, remat = _estimate(_CNN()), _estimate(jmem.convert(_CNN(), jmem.Remat()))
  actnn = _estimate(jmem.convert(_CNN(), jmem.ActNN("L3")))
  for e in (exact, remat, actnn):
    assert e.seconds == pytest.approx(e.memory_seconds + e.matmul_seconds + e.launch_seconds)
    assert e.dtype == "f32" and e.traffic.bytes > 0 and e.traffic.loops == 0
  assert remat.flops >= exact.flops and remat.traffic.kernels > exact.traffic.kernels
  assert actnn.traffic.kernels > exact.traffic.kernels
  assert exact.seconds < remat.seconds and exact.seconds < actnn.seconds


def test_the_estimate_refuses_what_it_cannot_charge():
  with pytest.raises(ValueError, match="lowered_flops"):
    measure.estimate_step_time(None, None)
  with pytest.raises(ValueError, match="constants are"):
    measure.estimate_step_time(None, 1.0, constants=(1.0, 1.0))


def test_the_shipped_constants_are_the_committed_fits():
  """jmem's H100 constants are the ones benchmarks/step_time.py --fit wrote (so a refit is
  committed with its results), from the twelve timed rows."""
  with open(os.path.join(ROOT, "benchmarks", "results", "step_time.json")) as f:
    fitted = json.load(f)
  assert tuple(fitted["constants"]) == _step_time.CONSTANT_NAMES
  assert _step_time.H100_CONSTANTS == pytest.approx(
      tuple(fitted["constants"].values()), rel=1e-3)
  assert len(fitted["rows"]) == 12


def _ranks(values):
  order = sorted(range(len(values)), key=values.__getitem__)
  ranks = [0.0] * len(values)
  for rank, i in enumerate(order):
    ranks[i] = float(rank)
  for v in set(values):                 # ties share their mean rank
    tied = [i for i, w in enumerate(values) if w == v]
    for i in tied:
      ranks[i] = sum(ranks[j] for j in tied) / len(tied)
  return ranks


def _spearman(x, y):
  rx, ry = _ranks(x), _ranks(y)
  mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def test_the_shipped_constants_predict_the_held_out_h100_rows():
  """Calibration: the shipped H100 constants, applied to the committed features of the
  H100 table's timed rows (each compiled for the target as it was timed), give every
  held-out row's step/exact ratio (bf16, flaxmodels' ResNet-50, the video ViT) within 0.05
  of the H100's measured one, and rank the twelve rows' ratios with a Spearman
  correlation of at least 0.9 (issue 49's check of the estimate)."""
  results = os.path.join(ROOT, "benchmarks", "results")
  with open(os.path.join(results, "step_time_features_2bdf73e.json")) as f:
    features = json.load(f)["rows"]
  with open(os.path.join(results, "step_time_features_7eb2f7d_vit.json")) as f:
    features.update(json.load(f)["rows"])
  with open(os.path.join(results, "gpu", "h100_2026-11-27_gpu_true_figures.json")) as f:
    table = json.load(f)["rows"]
  names = {"jmem ResNet-50": "resnet50-f32",
           "flaxmodels 0.1.3 ResNet50": "flaxmodels-resnet50-f32", "jmem video-vit": "video-vit"}

  def group(row):
    name = next(g for m, g in names.items() if row["model"].startswith(m))
    return "resnet50-bf16" if name == "resnet50-f32" and row["dtype"] == "bfloat16" else name

  def estimate(feat):
    dtype = {"float32": "f32", "bfloat16": "bf16"}[feat["dtype"]]
    return sum(k * c for k, c in zip(_step_time.H100_CONSTANTS, _step_time.columns(
        feat["bytes"], feat["flops"], feat["kernels"], dtype)))

  timed = [r for r in table if r["step_time_ratio"] is not None]
  assert len(timed) == 12
  measured, estimated = [], []
  for r in timed:
    g = group(r)
    ratio = estimate(features[f"{g}/{r['technique']}"]) / estimate(features[f"{g}/exact"])
    measured.append(r["step_time_ratio"])
    estimated.append(ratio)
    if g != "resnet50-f32" and r["technique"] != "exact":
      assert ratio == pytest.approx(r["step_time_ratio"], abs=0.05), (g, r["technique"])
  assert _spearman(measured, estimated) >= 0.9


def test_the_bench_on_the_h100_target_gives_an_estimated_step_time_column():
  """`jmem bench --target h100` estimates each row's step time from the module it compiled
  (labelled an estimate for the target); where no constants were fitted there is none."""
  from jmem import bench  # pylint: disable=g-import-not-at-top
  config = dict(model="resnet8", batch_size=8, image_size=8, memory_only=True,
                budgets_gib=(), techniques=("exact", "remat"))
  rows = bench.run_bench(bench.BenchConfig(target="h100", **config), quiet=True)
  exact, remat = rows
  assert exact["estimated_step_ratio"] == 1.0 and exact["estimated_step_s"] > 0
  assert remat["estimated_step_ratio"] > 1.0
  table = bench.format_table(rows)
  assert "step / exact (estimated for the H100 target)" in table
  assert f"| {remat['estimated_step_ratio']:.3f} |" in table
  # Elsewhere (this machine's backend, a spec file of another GPU) no constants: no column.
  assert measure.constants_for("default") is None
  assert "estimated" not in bench.format_table([dict(r, estimated_step_ratio=None)
                                                for r in rows])
