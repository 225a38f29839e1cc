"""A step-time estimate from the H100 target's compiled module, fitted and checked on the
H100's measured step times.

  python benchmarks/step_time.py --collect SOURCE --out FEATURES.json   # compile the rows
  python benchmarks/step_time.py --fit                                 # fit, check, write

The estimate (`jmem.measure.estimate_step_time`) is

    seconds = a * bytes / 3.0e12 + b * flops / rate(dtype) + c * kernels * 1e-6

with ``bytes`` what the module's kernels read and write (`jmem.measure.traffic` of the
compiled HLO: operands + results of every fusion, library call and copy of the entry
computation), ``flops`` the lowered module's FLOPs at the H100's dense TF32 (float32
steps) or bfloat16 tensor-core rate, and ``kernels`` the launches. ``a``, ``b``, ``c`` are
fitted by non-negative least squares on the five timed float32 rows of jmem's ResNet-50 in
the 2026-11-27 H100 table (``results/gpu/h100_2026-11-27_gpu_true_figures.json``) and
nothing else; the bfloat16, third-party and video-ViT rows are held out: each step/exact
ratio is checked against its measurement, and the rank correlation over all timed rows.

``--collect SOURCE`` compiles each row of `ROWS` for the H100 target with the jmem of the
checkout at SOURCE (its own ``benchmarks/gpu.py`` builds the step, as that commit's GPU run
did), one process per row, at the timed batch 128, and writes each row's traffic, lowered
FLOPs and temp bytes. The table was timed at commit 7eb2f7d, which predates the H100
target; its rows are compiled at 2bdf73e (``git worktree add /tmp/at_2bdf73e 2bdf73e``),
whose H100-target slopes agree with the table's measured ones to the target's fidelity
(ActNN 19.8 and 23.0, bf16 ActNN 18.3, flaxmodels' ActNN 32.0 MiB per example on both; exact
88.2 against 88.4) and whose code the H200 run of 2bdf73e timed
(``results/gpu/gpu_nvidia_h200_2026-11-28``). The table's ViT rows were timed at batch 16
with the model's own SBP of 7eb2f7d (its SBP blocks compute the kept tokens' queries and
MLP only; `jmem.convert`'s re-runs the MLP on every token): ``--collect SOURCE --rows vit``
compiles them from a checkout of 7eb2f7d (``git worktree add /tmp/at_7eb2f7d 7eb2f7d``) at
that batch with that commit's ``benchmarks/gpu.py``. jmem.convert's SBP at batch 128 is
also compared with the H200's time of it (another device). ``--fit`` reads the features (``results/step_time_features_*.json``),
fits, and writes ``results/step_time.{json,md}``, with the current commit's rows estimated
where their features were collected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
H100_TABLE = os.path.join(RESULTS, "gpu", "h100_2026-11-27_gpu_true_figures.json")
TIMED_BATCH = 128

# (gpu.py group, technique) of every timed row of the H100 table, and its row there.
ROWS = {
    ("resnet50-f32", "exact"): ("jmem ResNet-50", "float32", "exact"),
    ("resnet50-f32", "remat"): ("jmem ResNet-50", "float32", "remat"),
    ("resnet50-f32", "actnn-L3:xla"): ("jmem ResNet-50", "float32", "actnn-L3:xla"),
    ("resnet50-f32", "recompute-2bit:pallas"):
        ("jmem ResNet-50", "float32", "recompute-2bit:pallas"),
    ("resnet50-f32", "actnn-L3:pallas"): ("jmem ResNet-50", "float32", "actnn-L3:pallas"),
    ("resnet50-bf16", "exact"): ("jmem ResNet-50", "bfloat16", "exact"),
    ("resnet50-bf16", "remat"): ("jmem ResNet-50", "bfloat16", "remat"),
    ("resnet50-bf16", "actnn-L3:pallas"): ("jmem ResNet-50", "bfloat16", "actnn-L3:pallas"),
    ("flaxmodels-resnet50-f32", "exact"): ("flaxmodels 0.1.3 ResNet50", "float32", "exact"),
    ("flaxmodels-resnet50-f32", "actnn-L3"): ("flaxmodels 0.1.3 ResNet50", "float32", "actnn-L3"),
    ("video-vit", "exact"): ("jmem video-vit", "float32", "exact"),
    ("video-vit", "sbp-0.25"): ("jmem video-vit", "float32", "sbp-0.25"),
}
FIT_GROUP = "resnet50-f32"
# The H200 run of 2bdf73e timed jmem.convert's SBP of the ViT at batch 128: its ratio,
# reported beside the check (another device).
H200_VIT_SBP_RATIO = 0.85
# Rows of the current commit the fit estimates (the ones the README quotes).
CURRENT = (("resnet50-f32", "exact"), ("resnet50-f32", "remat"),
           ("resnet50-f32", "actnn-L3:xla"), ("resnet50-f32", "actnn-L3:pallas"),
           ("resnet50-bf16", "exact"), ("resnet50-bf16", "remat"),
           ("resnet50-bf16", "actnn-L3:xla"),
           ("flaxmodels-resnet50-f32", "exact"), ("flaxmodels-resnet50-f32", "actnn-L3"))


# ----------------------------------------------------------------------------- collect

def _collect_row(group: str, technique: str, traffic_path: str) -> dict:
  """In a process whose ``sys.path`` has the checkout: one row compiled for the H100."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  import gpu  # pylint: disable=g-import-not-at-top  (the checkout's benchmarks/gpu.py)
  from jmem import measure  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("_hlo_traffic", traffic_path)
  hlo = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = hlo          # dataclasses look their module up there
  spec.loader.exec_module(hlo)
  g = dict(gpu.GROUPS[group])
  t0 = time.perf_counter()
  step, abstract, x, y, _, _ = gpu._build(g, technique, TIMED_BATCH)  # pylint: disable=protected-access
  on = measure.target("h100")
  lowered = on.lower(step, abstract, x, y)
  compiled = on.compile_lowered(lowered)
  t = hlo.traffic(compiled.as_text())
  m = compiled.memory_analysis()
  return dict(group=group, technique=technique, dtype=g["dtype"], batch=TIMED_BATCH,
              bytes=t.bytes, kernels=t.kernels, library_calls=t.library_calls,
              loops=t.loops, by_opcode=t.by_opcode, library_dtype=t.library_dtype,
              flops=measure.lowered_flops(lowered),
              temp_bytes=int(m.temp_size_in_bytes), compile_seconds=time.perf_counter() - t0)


# The ViT rows of the H100 table were timed at batch 16 with the model's own SBP (commit
# 7eb2f7d's `VideoTransformer`, whose SBP blocks compute the kept tokens' queries and MLP
# only), which that commit's `benchmarks/gpu.py` builds; it predates `jmem.measure.target`.
VIT_ROWS = (("video-vit", "exact"), ("video-vit", "sbp-0.25"))
VIT_SOURCE, VIT_BATCH = "7eb2f7d", 16
VIT_FEATURES = os.path.join(RESULTS, f"step_time_features_{VIT_SOURCE}_vit.json")


def _collect_row_compat(group: str, technique: str, batch: int, traffic_path: str,
                        spec_path: str) -> dict:
  """`_collect_row` for a checkout without `jmem.measure.target`: its own
  ``benchmarks/gpu.py`` builds the step, compiled here for the spec file's GPU.

  Where the deviceless compile finds no Triton tiling for a matrix product, it is compiled
  again with Triton's products off (as `jmem.measure.Target.compile_lowered` does); where
  that fails on the step's scheduling barrier (jaxlib 0.10.2: "Unsupported instruction
  opcode: opt-barrier", in `sbp_rows`'s backward), the step is built again without it and
  the row says so (``without_barrier``): a barrier orders the schedule and keeps the two
  values it ties from fusing across it; it adds no kernel of its own."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  import gpu  # pylint: disable=g-import-not-at-top  (the checkout's benchmarks/gpu.py)
  spec = importlib.util.spec_from_file_location("_hlo_traffic", traffic_path)
  hlo = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = hlo
  spec.loader.exec_module(hlo)
  with open(spec_path) as f:
    device = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                          target_config=f.read()).devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  place = lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
  t0 = time.perf_counter()

  def compile_row():
    step, abstract, x, y, _, _ = gpu._build(dict(gpu.GROUPS[group]), technique, batch)  # pylint: disable=protected-access
    lowered = step.lower(*jax.tree.map(place, (abstract, x, y)))
    try:
      return lowered, lowered.compile(), False
    except Exception as e:  # pylint: disable=broad-except
      if "Couldn't find output tile sizes" not in str(e):
        raise
    return lowered, lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False}), True

  without_barrier = False
  try:
    lowered, compiled, cublas = compile_row()
  except Exception as e:  # pylint: disable=broad-except
    if "opt-barrier" not in str(e):
      raise
    import jmem.ops.sbp.core as sbp_core  # pylint: disable=g-import-not-at-top
    sbp_core.barrier = lambda tree: tree
    without_barrier = True
    lowered, compiled, cublas = compile_row()
  t = hlo.traffic(compiled.as_text())
  flops = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"),
                                        lowered.compiler_ir("hlo").as_hlo_module())["flops"]
  return dict(group=group, technique=technique, dtype=gpu.GROUPS[group]["dtype"],
              batch=batch, bytes=t.bytes, kernels=t.kernels, library_calls=t.library_calls,
              loops=t.loops, by_opcode=t.by_opcode, library_dtype=t.library_dtype,
              flops=float(flops), temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
              cublas_products=cublas, without_barrier=without_barrier,
              compile_seconds=time.perf_counter() - t0)


def collect(source: str, out: str, rows, batch: int = TIMED_BATCH,
            compat: bool = False) -> int:
  source = os.path.abspath(source)
  traffic_path = os.path.join(ROOT, "jmem", "measure", "_hlo_traffic.py")
  spec_path = os.path.join(ROOT, "jmem", "measure", "specs", "h100_sxm.txtpb")
  if not compat and batch != TIMED_BATCH:
    raise SystemExit(f"--batch is for --rows vit (the current rows are compiled at "
                     f"{TIMED_BATCH}).")
  done = {}
  if os.path.exists(out):
    with open(out) as f:
      done = json.load(f)
  commit = subprocess.run(["git", "-C", source, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
  dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--", "jmem"],
                         capture_output=True, text=True, check=False).stdout.strip()
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  sys.path.insert(0, HERE)     # after the children's paths are set: they import their own
  import _common  # pylint: disable=g-import-not-at-top
  # "commit": this script's, which wrote the file; "source_commit": the code compiled.
  done.setdefault("meta", {}).update(_common.stamp(
      "h100", source_commit=commit + ("+changes" if dirty else ""), batch=batch))
  done.setdefault("rows", {})
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([source, os.path.join(source,
                                                                          "benchmarks")]))
  env.setdefault("XLA_FLAGS", "")
  for group, technique in rows:
    key = f"{group}/{technique}"
    if key in done["rows"] and "error" not in done["rows"][key]:
      continue
    print(f"[{commit}] {key}: compiling for the H100 target", flush=True)
    call = (f"_collect_row_compat({group!r}, {technique!r}, {batch}, {traffic_path!r}, "
            f"{spec_path!r})" if compat else
            f"_collect_row({group!r}, {technique!r}, {traffic_path!r})")
    code = (f"import json, sys; sys.path.insert(0, {HERE!r}); import step_time; "
            f"print('ROW' + json.dumps(step_time.{call}))")
    # The checkout's benchmarks/ must come before this one's (both have gpu.py).
    code = code.replace(f"sys.path.insert(0, {HERE!r})", f"sys.path.append({HERE!r})")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, check=False, cwd=source)
    lines = [l for l in p.stdout.splitlines() if l.startswith("ROW")]
    done["rows"][key] = (json.loads(lines[-1][3:]) if p.returncode == 0 and lines else
                         dict(error=(p.stderr or p.stdout)[-1500:]))
    with open(out, "w") as f:
      json.dump(done, f, indent=1)
  with open(out, "w") as f:
    json.dump(done, f, indent=1)
  return 0


# --------------------------------------------------------------------------------- fit

def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--collect", metavar="SOURCE", help="a jmem checkout to compile the rows "
                 "with")
  p.add_argument("--rows", choices=("table", "current", "vit"), default="table",
                 help="with --collect: the H100 table's timed rows (its ViT rows apart), "
                 "the current ones, or the table's ViT rows (SOURCE: a checkout of "
                 f"{VIT_SOURCE}, compiled at batch {VIT_BATCH} as timed)")
  p.add_argument("--out", help="with --collect: the features file")
  p.add_argument("--fit", action="store_true")
  p.add_argument("--features", default=os.path.join(RESULTS, "step_time_features_2bdf73e.json"),
                 help="with --fit: the table rows' features")
  p.add_argument("--vit-features", default=VIT_FEATURES,
                 help="with --fit: the table's ViT rows' features (--rows vit)")
  p.add_argument("--current", default=os.path.join(RESULTS, "step_time_features_2af3742.json"),
                 help="with --fit: the current commit's rows' features, estimated")
  args = p.parse_args(argv)
  if args.collect:
    if args.rows == "vit":
      return collect(args.collect, args.out or VIT_FEATURES, VIT_ROWS, batch=VIT_BATCH,
                     compat=True)
    table = tuple(r for r in ROWS if r not in VIT_ROWS)
    return collect(args.collect, args.out, table if args.rows == "table" else CURRENT)
  if args.fit:
    return fit(args.features, args.current, args.vit_features)
  p.error("give --collect SOURCE --out FILE or --fit")
  return 2


def _nnls(rows, target):
  """argmin ||A w - t|| over w >= 0 (A: one row per step, a handful of columns; every
  active set tried)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  a, t = np.asarray(rows, float), np.asarray(target, float)
  best = (np.inf, np.zeros(a.shape[1]))
  for k in range(1, a.shape[1] + 1):
    for subset in itertools.combinations(range(a.shape[1]), k):
      w_s, *_ = np.linalg.lstsq(a[:, subset], t, rcond=None)
      if (w_s < 0).any():
        continue
      w = np.zeros(a.shape[1])
      w[list(subset)] = w_s
      err = float(((a @ w - t) ** 2).sum())
      if err < best[0]:
        best = (err, w)
  return best[1]


def _spearman(x, y) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top

  def ranks(v):
    v = np.asarray(v, float)
    order = v.argsort(kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v))
    for value in np.unique(v):           # ties share their mean rank
      r[v == value] = r[v == value].mean()
    return r
  rx, ry = ranks(x), ranks(y)
  return float(np.corrcoef(rx, ry)[0, 1])


def _note(feat) -> str:
  """What a row's features say about how it was compiled, where that is not the default."""
  notes = []
  if feat.get("batch", TIMED_BATCH) != TIMED_BATCH:
    notes.append(f"batch {feat['batch']}, as timed")
  if feat.get("without_barrier"):
    notes.append("compiled without its scheduling barrier (the deviceless compile refuses "
                 "it)")
  return "; ".join(notes)


def _dtype(feat) -> str:
  """The rate's element type: the step's compute dtype (what `jmem.measure.traffic` reads
  from its cuDNN calls; early features counted Pallas calls too, so not read from them)."""
  return {"float32": "f32", "bfloat16": "bf16"}[feat["dtype"]]


def _measured() -> dict:
  """(model, dtype, technique) -> measured ms of the H100 table's timed rows."""
  with open(H100_TABLE) as f:
    table = json.load(f)
  exact = {(r["model"], r["dtype"]): r["step_time_ms"] for r in table["rows"]
           if r["technique"] == "exact"}
  out = {}
  for r in table["rows"]:
    model = r["model"].split(" 16x")[0]
    if r["step_time_ratio"] is not None:
      out[(model, r["dtype"], r["technique"])] = r["step_time_ratio"] * exact[
          (r["model"], r["dtype"])]
  return out, table["meta"]


def fit(features_path: str, current_path: str | None, vit_path: str) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")      # the stamp needs a backend, not a GPU
  sys.path.insert(0, HERE)     # not at import: a --collect child imports its checkout's
  import _common  # pylint: disable=g-import-not-at-top
  from jmem.measure import _step_time  # pylint: disable=g-import-not-at-top
  with open(features_path) as f:
    features = json.load(f)
  with open(vit_path) as f:
    vit = json.load(f)
  measured, table_meta = _measured()
  rows = []
  for (group, technique), key in ROWS.items():
    source, path = (vit, vit_path) if (group, technique) in VIT_ROWS else (features,
                                                                          features_path)
    feat = source["rows"].get(f"{group}/{technique}")
    if feat is None or "error" in feat:
      raise SystemExit(f"no features for {group}/{technique} in {path}: run "
                       "--collect first")
    rows.append(dict(group=group, technique=technique, row=key, ms=measured[key],
                     columns=_step_time.columns(feat["bytes"], feat["flops"],
                                                feat["kernels"], _dtype(feat)),
                     features={k: feat[k] for k in ("bytes", "flops", "kernels",
                                                   "temp_bytes", "dtype", "batch")},
                     note=_note(feat)))
  train = [r for r in rows if r["group"] == FIT_GROUP]
  w = _nnls([r["columns"] for r in train], [r["ms"] * 1e-3 for r in train])
  exact_ms = {}
  for r in rows:
    r["estimated_ms"] = 1e3 * sum(wi * ci for wi, ci in zip(w, r["columns"]))
    if r["technique"] == "exact":
      exact_ms[r["group"]] = (r["estimated_ms"], r["ms"])
  for r in rows:
    est_exact, meas_exact = exact_ms[r["group"]]
    r["estimated_ratio"] = r["estimated_ms"] / est_exact
    r["measured_ratio"] = r["ms"] / meas_exact
    r["held_out"] = r["group"] != FIT_GROUP
    r["ratio_error"] = r["estimated_ratio"] - r["measured_ratio"]
  held = [r for r in rows if r["held_out"] and r["technique"] != "exact"]
  timed_ms = rows
  # jmem.convert's SBP (what a user runs today), at batch 128, against the H200's time of
  # it (another device: its bandwidth is 1.43x the H100's at the same TF32 rate).
  h200 = {t: 1e3 * sum(wi * ci for wi, ci in zip(w, _step_time.columns(
      f["bytes"], f["flops"], f["kernels"], _dtype(f))))
          for t in ("exact", "sbp-0.25") for f in [features["rows"][f"video-vit/{t}"]]}
  checks = dict(
      held_out_max_ratio_error=max(abs(r["ratio_error"]) for r in held),
      held_out_within_0_05=all(abs(r["ratio_error"]) <= 0.05 for r in held),
      spearman_ms=_spearman([r["ms"] for r in timed_ms], [r["estimated_ms"] for r in timed_ms]),
      rows_in_spearman_ms=len(timed_ms),
      spearman_ratio=_spearman([r["measured_ratio"] for r in rows],
                               [r["estimated_ratio"] for r in rows]),
      # Without the exact rows (1.0 in both, agreeing by construction).
      spearman_ratio_techniques=_spearman(
          [r["measured_ratio"] for r in rows if r["technique"] != "exact"],
          [r["estimated_ratio"] for r in rows if r["technique"] != "exact"]),
      vit_sbp_vs_h200_b128=h200["sbp-0.25"] / h200["exact"] - H200_VIT_SBP_RATIO,
      fit_rms_ratio_error=float(sum(r["ratio_error"] ** 2 for r in train) / len(train)) ** .5)
  current = []
  if current_path and os.path.exists(current_path):
    with open(current_path) as f:
      cur = json.load(f)
    est = {}
    for key, feat in cur["rows"].items():
      if "error" in feat:
        continue
      cols = _step_time.columns(feat["bytes"], feat["flops"], feat["kernels"], _dtype(feat))
      est[key] = 1e3 * sum(wi * ci for wi, ci in zip(w, cols))
    for key, ms in est.items():
      group = key.split("/")[0]
      base = est.get(f"{group}/exact")
      current.append(dict(row=key, estimated_ms=ms,
                          estimated_ratio=None if base is None else ms / base,
                          temp_bytes=cur["rows"][key]["temp_bytes"]))
    current_commit = cur["meta"]["source_commit"]
  else:
    current_commit = None
  meta = _common.stamp(
      "h100", features_from=features["meta"]["source_commit"],
      vit_features_from=vit["meta"]["source_commit"],
      timed=dict(device=table_meta["device"], commit=table_meta["commit"],
                 jax=table_meta["jax_version"], date=table_meta["date"]),
      current_rows_from=current_commit)
  out = dict(meta=meta, constants=dict(zip(_step_time.CONSTANT_NAMES, map(float, w))),
             checks=checks, rows=rows, current=current)
  _common.write_report("step_time", out, _markdown(out).splitlines())
  return 0


def _markdown(out: dict) -> str:
  m, c, k = out["meta"], out["constants"], out["checks"]
  lines = [
      "# A step-time estimate from the H100 target's compiled module",
      "",
      "Written by `python benchmarks/step_time.py --fit`. Features: each row compiled for "
      "the H100 target (deviceless) as it was timed: the ResNet-50 rows at batch "
      f"{TIMED_BATCH} at commit {m['features_from']}, the video ViT's at batch {VIT_BATCH} "
      f"with the model's own SBP of commit {m['vit_features_from']}, which the table timed "
      f"(`--collect <checkout> --rows vit`); times: {m['timed']['device']}, JAX "
      f"{m['timed']['jax']}, {m['timed']['date']}, commit {m['timed']['commit']} "
      "(results/gpu/h100_2026-11-27_gpu_true_figures.json).",
      "",
      "seconds = a * bytes / 3.0e12 + b * flops / rate + c * kernels * 1e-6 (rate: "
      f"{_rates()}); fitted on the five float32 rows of jmem's ResNet-50 only: "
      + ", ".join(f"{n} = {v:.3f}" for n, v in c.items()) + ".",
      "",
      "| group | technique | measured ms | estimated ms | measured / exact | "
      "estimated / exact | error | |",
      "|---|---|---:|---:|---:|---:|---:|---|"]
  for r in out["rows"]:
    ms = f"{r['ms']:.1f}"
    lines.append(f"| {r['group']} | {r['technique']} | {ms} | "
                 f"{r['estimated_ms']:.1f} | {r['measured_ratio']:.3f} | "
                 f"{r['estimated_ratio']:.3f} | {r['ratio_error']:+.3f} | "
                 f"{'held out' if r['held_out'] else 'fitted'}"
                 f"{'; ' + r['note'] if r['note'] else ''} |")
  lines += [
      "",
      f"- held-out step/exact ratios: largest error {k['held_out_max_ratio_error']:.3f} "
      f"({'all within' if k['held_out_within_0_05'] else 'not all within'} +-0.05)",
      f"- rank correlation (Spearman): step/exact ratio over the twelve timed rows "
      f"{k['spearman_ratio']:.3f}, over the eight that are not exact (whose 1.0 agree by "
      f"construction) {k['spearman_ratio_techniques']:.3f}; step time over the "
      f"{k['rows_in_spearman_ms']} whose milliseconds compare {k['spearman_ms']:.3f}",
      "- features: `--collect` at commit c6b3450's tree; the first rows were compiled "
      "before `library_dtype` was recorded, which the fit does not read (it charges each "
      "step's own dtype); rows compiled again gave the same bytes and kernels",
      "- the ViT rows: H100 run 3 (results/gpu/gpu_nvidia_h100_80gb_hbm3_run3.md, commit "
      "e53549a, the same model's own SBP at batch 16) measured its SBP at 0.854 of exact, "
      "the table 0.807: two runs of one step differ by 0.05",
      f"- jmem.convert's SBP of the same ViT (which re-runs the MLP on every token, see "
      f"docs/sbp.md) at batch 128, estimated for the H100, against the H200's time of it "
      f"(ratio {H200_VIT_SBP_RATIO}, results/gpu/gpu_nvidia_h200_2026-11-28_run2.md; another "
      f"device): {k['vit_sbp_vs_h200_b128']:+.3f}",
      f"- fitted rows' rms ratio error: {k['fit_rms_ratio_error']:.3f}"]
  if out["current"]:
    lines += ["", f"## Estimated at commit {m['current_rows_from']} (not measured on a GPU)",
              "", "| row | estimated ms | estimated / exact | temp GiB (H100 target) |",
              "|---|---:|---:|---:|"]
    for r in out["current"]:
      ratio = "-" if r["estimated_ratio"] is None else f"{r['estimated_ratio']:.3f}"
      lines.append(f"| {r['row']} | {r['estimated_ms']:.1f} | {ratio} | "
                   f"{r['temp_bytes'] / 2**30:.3f} |")
  return "\n".join(lines) + "\n"


def _rates() -> str:
  from jmem.measure import _step_time  # pylint: disable=g-import-not-at-top
  return ", ".join(f"{d} {r / 1e12:.0f} TFLOP/s" for d, r in _step_time.MATMUL_RATE.items())


if __name__ == "__main__":
  sys.exit(main())
