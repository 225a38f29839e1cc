"""The GPU path from a CPU machine: whole train steps with the Pallas kernels lower for CUDA."""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from jmem import bench, models, train
from pallas_kernels import lowering_for_gpu


@pytest.mark.slow
@pytest.mark.parametrize("technique,dtype", [("actnn-L3:pallas", jnp.float32),
                                             ("inplace-abn:pallas", jnp.bfloat16),
                                             ("actnn-L3:pallas", jnp.bfloat16),
                                             ("inplace-abn", jnp.float32),
                                             ("sync-bn:pallas", jnp.bfloat16)])
def test_train_step_lowers_for_cuda_with_its_kernels(technique, dtype):
  # InPlace-ABN needs invertible activations: preact20's leaky_relu (resnet8 has ReLU).
  name = "preact20" if technique.startswith("inplace") else "resnet8"
  model = bench.build_model(technique, models.create_model(name, 10, dtype=dtype),
                            bench.make_dataset(name, 16), 8)
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  one = jax.ShapeDtypeStruct((1, 16, 16, 1), jnp.float32)
  state = jax.eval_shape(lambda k, x: train.init_state(fns, opt, k, x), jax.random.key(0), one)
  x = jax.ShapeDtypeStruct((8, 16, 16, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((8,), jnp.int32)
  step = train.make_train_step(fns, opt)     # outside: it makes a key eagerly
  with lowering_for_gpu():
    text = step.trace(state, x, y).lower(lowering_platforms=("cuda",)).as_text()
  # Each compressed residual: one quantize and one dequantize launch; InPlace-ABN: four
  # launches per layer (statistics, normalise, backward sums, dx); SyncBN: one per layer
  # (statistics; resnet8 has 9 BatchNorms).
  assert text.count("__gpu$xla.gpu.triton") >= 8


def test_automatic_actnn_lowers_no_kernels_for_cuda():
  """ActNN's automatic choice on a GPU is its XLA path (benchmarks/results/gpu/: the
  kernels made the step slower and bigger): no kernel in the lowered step, no warning."""
  model = bench.build_model("actnn-L3", models.create_model("resnet8", 10,
                                                            dtype=jnp.bfloat16),
                            bench.make_dataset("resnet8", 16), 8)
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  one = jax.ShapeDtypeStruct((1, 16, 16, 1), jnp.float32)
  state = jax.eval_shape(lambda k, x: train.init_state(fns, opt, k, x), jax.random.key(0), one)
  step = train.make_train_step(fns, opt)
  with lowering_for_gpu(), warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    text = step.trace(state, jax.ShapeDtypeStruct((8, 16, 16, 1), jnp.float32),
                      jax.ShapeDtypeStruct((8,), jnp.int32)).lower(
                          lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" not in text


def test_technique_implementation_suffix():
  assert bench.get_technique("actnn-L3:pallas").implementation == "pallas"
  assert bench.get_technique("inplace-abn:xla").implementation == "xla"
  assert bench.get_technique("actnn-L3").implementation is None
  with pytest.raises(ValueError, match="has no kernels"):
    bench.get_technique("remat:pallas")
  for bad in ("actnn-L3:triton", "actnn-L3:"):
    with pytest.raises(ValueError, match="Unknown implementation"):
      bench.get_technique(bad)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["actnn-L3:pallas", "inplace-abn:pallas", "sync-bn:pallas"])
def test_converted_third_party_step_lowers_for_cuda_with_its_kernels(name):
  """``implementation=`` through jmem.convert's technique objects, on a model jmem did not
  write: the whole train step lowers for CUDA with the Pallas kernels in it."""
  import jmem  # pylint: disable=g-import-not-at-top
  import third_party_models as tp  # pylint: disable=g-import-not-at-top
  make, shape = ((tp.ThirdPartyResNet, (8, 16, 16, 3)) if not name.startswith("inplace")
                 else (tp.SequentialABNCNN, (8, 8, 8, 3)))
  # The bench's inplace-abn fixes leaky_relu 0.01; this model's own pairs say what they are.
  overrides = dict(activation=None, slope=None) if name.startswith("inplace") else {}
  model = jmem.convert(make(), jmem.technique(name, **overrides))
  fns = train.model_fns(model)
  opt = train.default_optimizer(1e-3, 10)
  one = jax.ShapeDtypeStruct((1,) + shape[1:], jnp.float32)
  state = jax.eval_shape(lambda k, x: train.init_state(fns, opt, k, x), jax.random.key(0), one)
  step = train.make_train_step(fns, opt)
  with lowering_for_gpu():
    text = step.trace(state, jax.ShapeDtypeStruct(shape, jnp.float32),
                      jax.ShapeDtypeStruct((shape[0],), jnp.int32)).lower(
                          lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") >= 8


def test_halo_conv_depthwise_gradient_per_platform():
  """A depthwise `halo_conv`'s kernel gradient: for CUDA the batch-grouped convolution of
  autodiff (cuDNN's own), for CPU the feature-grouped form jmem uses there instead."""
  from jax.sharding import AxisType, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jmem.parallel import spatial  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((2, 4), ("h", "w"), axis_types=(AxisType.Auto,) * 2)
  spec = P(None, "h", "w", None)

  def loss(x, k):
    y = jax.shard_map(lambda v, w: spatial.halo_conv(v, w, feature_group_count=8,
                                                     axis_names=("h", "w")),
                      mesh=mesh, in_specs=(spec, P()), out_specs=spec)(x, k)
    return jnp.sum(y ** 2)
  args = (jax.ShapeDtypeStruct((2, 8, 16, 8), jnp.float32),
          jax.ShapeDtypeStruct((7, 7, 1, 8), jnp.float32))
  traced = jax.jit(jax.grad(loss, (0, 1))).trace(*args)
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
  assert cuda.count("batch_group_count = 8") == 1
  assert "batch_group_count" not in cpu.replace("batch_group_count = 1 ", "")


def test_gpu_benchmark_without_a_gpu_exits_0_and_writes_nothing(tmp_path):
  """``python benchmarks/gpu.py`` on a CPU machine: its "no GPU" message, status 0, and no
  file anywhere it could write (its output directory, its working directory, temp)."""
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
  cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
  cwd.mkdir()
  tmp.mkdir()
  env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)     # conftest's cache: "writes nothing" covers it
  proc = subprocess.run([sys.executable, str(script), "--output-dir", str(tmp_path / "out")],
                        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "no GPU here" in proc.stdout, proc.stdout
  assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd", "tmp"]
  assert not any(cwd.iterdir()) and not any(tmp.iterdir())


def _gpu_script(name="gpu"):
  """``benchmarks/<name>.py`` imported as a module."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"jmem_{name}_benchmark", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow
def test_gpu_benchmark_rows_are_registered_techniques_on_models_users_have():
  """Every row of benchmarks/gpu.py is a registered name on a plain model, converted as a
  user converts it (flaxmodels' ResNet50 among them), and its H100-target prediction
  compiles (exact on the quick ResNet-8: the slope and a largest batch confirmed)."""
  import jmem  # pylint: disable=g-import-not-at-top
  gpu = _gpu_script()
  for groups in (gpu.GROUPS, gpu.QUICK_GROUPS):
    for gname, g in groups.items():
      model = gpu.make_model(g)
      for t in g["techniques"]:
        bench.get_technique(t)
        converted = gpu.convert(model, t)
        assert (converted is model) == (t == "exact"), (gname, t)
        if t != "exact":
          assert isinstance(converted.techniques[0], type(jmem.technique(t))), (gname, t)
  assert type(gpu.make_model(gpu.GROUPS["flaxmodels-resnet50-f32"])).__module__.startswith(
      "flaxmodels")
  row = gpu.predict_row(gpu.QUICK_GROUPS["resnet8-f32"], "exact")
  assert row["max_batch_confirmed"] and row["per_example_temp_bytes"] > 0
  assert set(row["memory"]) >= {"8", "16", str(row["max_batch"])}


def test_gpu_benchmark_report_puts_each_row_beside_its_prediction(tmp_path):
  gpu = _gpu_script()
  mem = lambda gib: {"temp_bytes": int(gib * 2**30), "total_bytes": int(4 * gib * 2**30)}
  rows = {"exact": dict(compiled={"8": mem(1.0), "16": mem(2.0)},
                        per_example_temp_bytes=2**30 / 8,
                        run=dict(step_time_s=0.2, peak_bytes_in_use=3 * 2**30),
                        predicted=dict(memory={"8": mem(1.01), "16": mem(1.99)})),
          "remat": dict(compiled={"8": mem(0.4), "16": mem(0.7)},
                        per_example_temp_bytes=0.3 * 2**30 / 8,
                        run=dict(step_time_s=0.3, peak_bytes_in_use=1.8 * 2**30)),
          "actnn-L3:pallas": dict(error="not measured (time budget): worker stopped")}
  gpu._vs_exact(rows, (8, 16))  # pylint: disable=protected-access
  vs = rows["remat"]["vs_exact"]
  assert vs["step_time"] == pytest.approx(1.5) and vs["peak_bytes_in_use"] == 0.6
  assert vs["temp_bytes"] == pytest.approx(0.35) and vs["max_batch"] == pytest.approx(1 / 0.3)
  assert "vs_exact" not in rows["actnn-L3:pallas"]
  results = dict(meta=dict(device_kind="NVIDIA H100 80GB HBM3", commit="abc"),
                 predicted_from=dict(commit="def", jaxlib="0.10.2"), log=["[0.0s] done"],
                 groups={"g": dict(config=dict(model="resnet8", image=16, frames=None,
                                               dtype="float32", batches=(8, 16)), rows=rows)})
  gpu._write(results, str(tmp_path / "out"))  # pylint: disable=protected-access
  md = (tmp_path / "out.md").read_text()
  assert "| exact | 200.0 | 1.00 | - | 3.000 | 1.000 (1.010) | 2.000 (1.990) | 128.0 | 1.00 |" \
      in md, md
  assert "| remat | 300.0 | 1.50 | - | 1.800 | 0.400 (-) | 0.700 (-) | 38.4 | 3.33 |" in md, md
  assert "| actnn-L3:pallas | not measured (time budget)" in md
  assert "commit def" in md


def test_offload_diagnostic_reads_host_transfers_from_a_scheduled_module():
  """benchmarks/gpu_offload.py's `host_transfers` on a scheduled module written as XLA
  prints one: a copy to the host whose copy-done comes only in the backward pass (its
  device source held through the forward), one done at once, one started after both ended
  (held bytes are the most in flight at once, not the sum), a copy back started in the
  forward pass, one in the backward, and a synchronous copy each way; the same module
  printed without ``%`` and with operand shapes reads the same."""
  module = _gpu_script("gpu_offload")
  hlo = """HloModule jit_step, is_scheduled=true

%fused (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %copy-start.9 = (f32[4,8]{1,0:S(5)}, f32[4,8]{1,0}, u32[]) copy-start(%p)
}

ENTRY %main.3 (x: f32[64,32], w: f32[32,32]) -> f32[64,32] {
  %x = f32[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[32,32]{1,0} parameter(1)
  %dot.1 = f32[64,32]{1,0} custom-call(%x, %w), custom_call_target="__cublas$gemm"
  %copy-start.1 = (f32[64,32]{1,0:T(8,128)S(5)}, f32[64,32]{1,0}, u32[]) copy-start(%dot.1)
  %copy-start.2 = (f32[32,32]{1,0:S(5)}, f32[32,32]{1,0}, u32[]) copy-start(%w)
  %copy-done.2 = f32[32,32]{1,0:S(5)} copy-done(%copy-start.2)
  %copy.7 = bf16[16]{0:S(5)} copy(%x)
  %copy-start.3 = (f32[32,32]{1,0}, f32[32,32]{1,0:S(5)}, u32[]) copy-start(%copy-done.2)
  %tanh.4 = f32[64,32]{1,0} tanh(%x), metadata={op_name="jit(step)/transpose(jvp(f))/t"}
  %copy-done.1 = f32[64,32]{1,0:T(8,128)S(5)} copy-done(%copy-start.1)
  %copy-done.3 = f32[32,32]{1,0} copy-done(%copy-start.3), metadata={op_name="a = (b)"}
  %copy-start.5 = (f32[8,8]{1,0:S(5)}, f32[8,8]{1,0}, u32[]) copy-start(%tanh.4)
  %copy-done.5 = f32[8,8]{1,0:S(5)} copy-done(%copy-start.5)
  %copy-start.6 = (f32[64,32]{1,0}, f32[64,32]{1,0:S(5)}, u32[]) copy-start(%copy-done.1)
  %copy-done.6 = f32[64,32]{1,0} copy-done(%copy-start.6)
  %copy.8 = bf16[16]{0} copy(%copy.7)
  ROOT %add.2 = f32[64,32]{1,0} add(%copy-done.6, %copy-done.3)
}
"""
  big, mid, small = 64 * 32 * 4, 32 * 32 * 4, 8 * 8 * 4
  want = dict(to_host=3, to_host_bytes=big + mid + small, to_device=2,
              to_device_bytes=mid + big, held_max_bytes=big + mid, backward_from="transpose",
              to_host_done_in_backward_bytes=big + small,
              to_device_started_in_forward_bytes=mid,
              sync_copy_bytes={"to_host": 32, "to_device": 32}, unpaired_copy_starts=0,
              host_arrays=7, module_copy_starts_to_host=4, instructions=17)
  t = module.host_transfers(hlo)
  assert {k: t[k] for k in want} == want, t
  # Other print styles: names without "%", operands printed with their shapes.
  bare = hlo.replace("%", "")
  shaped = re.sub(r"copy-done\(%(copy-start\.\d)\)",
                  lambda m: f"copy-done((f32[8]{{0:S(5)}}, f32[8]{{0}}, u32[]) %{m.group(1)})",
                  hlo)
  for text in (bare, shaped):
    other = module.host_transfers(text)
    assert {k: other[k] for k in want} == want, other
  # Without the transpose op, the backward starts at the first copy back.
  t = module.host_transfers(hlo.replace("transpose(", "t("))
  assert t["backward_from"] == "first copy back" and t["to_device_started_in_forward_bytes"] == 0
  assert t["to_host_done_in_backward_bytes"] == big + small, t
  # A copy-done this reader cannot find is counted, not silently dropped.
  t = module.host_transfers(hlo.replace("copy-done(%copy-start.1)", "copy-done(%elsewhere)"))
  assert t["unpaired_copy_starts"] == 1 and t["to_host"] == 2, t
  none = module.host_transfers(hlo.replace(":S(5)", "").replace("S(5)", ""))
  assert none["to_host_bytes"] == none["to_device_bytes"] == none["held_max_bytes"] == 0
