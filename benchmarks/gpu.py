"""jmem's GPU table: what each technique costs on an H100, predicted here and measured there.

  python benchmarks/gpu.py --predict        # any machine with jmem[gpu-target]: no GPU needed
  python benchmarks/gpu.py                  # on a GPU: --time-budget 540 (seconds) by default

Every row is a model, a dtype and a technique, built as a user builds it
(``jmem.convert(model, jmem.technique(name))``; ActNN at its bits everywhere, not
calibrated), trained by the whole AdamW step (`jmem.train`'s, ``optax.adamw(1e-3)``,
parameters, optimiser state and batch statistics donated). `GROUPS` holds the rows: jmem's
ResNet-50 224² in float32 and bfloat16, a ResNet-50 jmem did not write (flaxmodels 0.1.3's
``ResNet50``, a benchmark dependency) and jmem's video ViT with SBP.

``--predict`` compiles each row for the H100 target (`jmem.measure.target`: XLA:GPU's buffer
assignment computed on this machine) at two batch sizes (the slope: what one more example
costs) and at the largest batch the slope puts within the H100's memory limit (confirmed
fitting by that compile), and writes ``results/gpu/h100_target.{json,md}``: the memory
columns of the README's and docs/gpu.md's tables. Commit it: a GPU run reads it.

On a GPU it works in two phases within ``--time-budget``, writing its results after every
row: (1) every row compiled at both batch sizes in parallel processes that fill a persistent
compilation cache on local disk and exit; (2) each row timed in a fresh process, one at a
time on the otherwise idle GPU (its step a cache hit, no autotuning beside it): the median of
10 steps at the larger batch, and ``peak_bytes_in_use`` (the process's own). Each row then
stands beside the committed prediction (temp bytes at both batches: the H100 target's
fidelity). Then, while time is left, the Pallas kernels' bandwidth. Results name the commit,
JAX version and device: ``results/gpu/gpu_<device>_<date>.{json,md}``. Where there is no GPU
it says so and exits 0 (``--allow-cpu --quick`` runs the GPU pipeline on tiny shapes on the
CPU, to check it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

RESULTS = os.path.join(HERE, "results", "gpu")
PREDICTED = os.path.join(RESULTS, "h100_target.json")

# name -> the model ("<registered jmem name>" or "flaxmodels:ResNet50"), its input (image
# side, frames for video), dtype, model overrides, the two batch sizes of the slope (the
# second is the timed one) and the techniques (registered names, ":xla"/":pallas" suffixes).
GROUPS = {
    "resnet50-f32": dict(
        model="resnet50", image=224, frames=None, dtype="float32", overrides={},
        classes=1000, batches=(64, 128),
        techniques=("exact", "remat", "actnn-L3:xla", "actnn-L3:pallas",
                    "recompute-2bit:pallas")),
    "resnet50-bf16": dict(
        model="resnet50", image=224, frames=None, dtype="bfloat16", overrides={},
        classes=1000, batches=(64, 128),
        techniques=("exact", "remat", "actnn-L3:xla", "actnn-L3:pallas")),
    "flaxmodels-resnet50-f32": dict(
        model="flaxmodels:ResNet50", image=224, frames=None, dtype="float32", overrides={},
        classes=1000, batches=(64, 128), techniques=("exact", "remat", "actnn-L3")),
    "video-vit": dict(
        model="video-vit", image=112, frames=16, dtype="float32",
        overrides=dict(patch=16, dim=384, depth=8, heads=6, exact_last=2), classes=10,
        batches=(64, 128), techniques=("exact", "sbp-0.25")),
}
# Tiny shapes, to check the pipeline on a CPU (--quick).
QUICK_GROUPS = {
    "resnet8-f32": dict(model="resnet8", image=16, frames=None, dtype="float32", overrides={},
                        classes=10, batches=(8, 16),
                        techniques=("exact", "remat", "actnn-L3:pallas")),
    "video-vit": dict(model="video-vit", image=24, frames=4, dtype="float32", overrides={},
                      classes=10, batches=(4, 8), techniques=("exact", "sbp-0.25")),
}
# Fractions of --time-budget by which compiling, then timing, must end (the kernels' bandwidth
# takes what is left).
COMPILE_SHARE = 0.45
TIME_SHARE = 0.90
TIMED_STEPS = 10
# The memory-bound kernels' goal: this fraction of the device's nominal HBM bandwidth.
BANDWIDTH_GOAL = 0.80
NOMINAL_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12,
                     "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12}
NOT_MEASURED = "not measured (time budget)"


# ----------------------------------------------------------------------- building a row

def _setup_jax():
  import jax  # pylint: disable=g-import-not-at-top
  cache = os.environ.get("JMEM_GPU_BENCH_CACHE")
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return jax


def make_model(group: dict):
  """The group's plain model (no technique): jmem's registered one, or flaxmodels'."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import bench  # pylint: disable=g-import-not-at-top
  if group["model"].startswith("flaxmodels:"):
    import flaxmodels  # pylint: disable=g-import-not-at-top
    if group["dtype"] != "float32":
      raise ValueError("flaxmodels' ResNet50 is measured in float32 only.")
    return getattr(flaxmodels, group["model"].split(":", 1)[1])(
        output="logits", pretrained=None, num_classes=group["classes"], dtype="float32")
  overrides = dict(group["overrides"])
  if group["dtype"] != "float32":
    overrides["dtype"] = jnp.dtype(group["dtype"])
  from jmem import models  # pylint: disable=g-import-not-at-top
  bench.check_dtype(group["model"], group["dtype"])
  return models.create_model(group["model"], group["classes"], **overrides)


def convert(model, technique: str):
  """``model`` with the registered ``technique`` on, as a user writes it:
  ``jmem.convert(model, jmem.technique(name))``, SBP on the model's own ``sbp_sites``."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jmem  # pylint: disable=g-import-not-at-top
  t = jmem.technique(technique)
  if t is None:
    return model
  if isinstance(t, jmem.SBP):
    t = dataclasses.replace(t, where=model.sbp_sites, mode=model.sbp_mode)
  return jmem.convert(model, t)


def _build(group: dict, technique: str, batch: int):
  """``(step, abstract_state, x_spec, y_spec, make_state, make_batch)`` of one row."""
  jax = _setup_jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jmem import train  # pylint: disable=g-import-not-at-top
  if group["frames"] is None:
    shape = (group["image"], group["image"], 1 if group["image"] < 32 else 3)
  else:
    shape = (group["frames"], group["image"], group["image"], 1)
  fns = train.model_fns(convert(make_model(group), technique))
  optimizer = optax.adamw(1e-3)
  x_spec = jax.ShapeDtypeStruct((batch,) + shape, jnp.float32)
  y_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
  abstract = train.abstract_state(fns, optimizer, x_spec)
  step = train.make_train_step(fns, optimizer, donate=True)
  one = jax.ShapeDtypeStruct((1,) + shape, jnp.float32)

  def make_state():
    return jax.jit(lambda k: train.init_state(fns, optimizer, k, jnp.zeros(one.shape)))(
        jax.random.key(0))

  def make_batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return (jax.random.normal(kx, x_spec.shape, jnp.float32),
            jax.random.randint(ky, (batch,), 0, group["classes"], jnp.int32))
  return step, abstract, x_spec, y_spec, make_state, make_batch


def _memory(compiled, lowered=None) -> dict:
  from jmem import measure  # pylint: disable=g-import-not-at-top
  m = compiled.memory_analysis()
  out = dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
             output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] +
                        out["temp_bytes"])
  # The lowered module's FLOPs (a GPU's compiled module counts cuDNN calls as nothing).
  out["flops_lowered"] = None if lowered is None else measure.lowered_flops(lowered)
  return out


def _slope(memory: dict, batches) -> dict:
  b0, b1 = batches
  m0, m1 = memory[str(b0)], memory[str(b1)]
  per = (m1["temp_bytes"] - m0["temp_bytes"]) / (b1 - b0)
  total = (m1["total_bytes"] - m0["total_bytes"]) / (b1 - b0)
  return dict(per_example_temp_bytes=per, per_example_bytes=total,
              fixed_bytes=m0["total_bytes"] - total * b0)


# --------------------------------------------------------------------------- --predict

def predict_row(group: dict, technique: str, target="h100") -> dict:
  """One row compiled for ``target`` (`jmem.measure.fit_step`): memory at both batch sizes,
  the slope, and the largest batch within the target's limit, compiled to confirm it (with
  any `jmem.measure.TargetFallbackWarning` the compiles gave, in ``fallbacks``)."""
  import warnings  # pylint: disable=g-import-not-at-top
  from jmem import measure  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  built = {}

  def args_at(b):
    if b not in built:
      built[b] = _build(group, technique, b)
    step, abstract, x, y, _, _ = built[b]
    return abstract, x, y
  step = _build(group, technique, group["batches"][0])[0]
  on = measure.target(target)
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", measure.TargetFallbackWarning)
    fit = measure.fit_step(step, args_at, target=on, batch_sizes=tuple(group["batches"]))
  fallbacks = sorted({str(w.message) for w in seen
                      if issubclass(w.category, measure.TargetFallbackWarning)})
  limit = on.memory_limit
  best = fit.max_batch[limit]
  return dict(
      memory={str(b): dict(temp_bytes=m.temp_bytes, argument_bytes=m.argument_bytes,
                           output_bytes=m.output_bytes, alias_bytes=m.alias_bytes,
                           total_bytes=m.total_bytes)
              for b, m in sorted(fit.memory.items())},
      per_example_temp_bytes=fit.per_example_temp_bytes,
      per_example_bytes=fit.per_example_bytes, fixed_bytes=fit.fixed_bytes,
      flops_lowered=fit.flops, max_batch=best, over_budget=fit.over_budget[limit],
      max_batch_confirmed=best is not None and best in fit.memory and
      fit.memory[best].total_bytes <= limit, memory_limit=limit, compiles=fit.compiles,
      fallbacks=fallbacks, seconds=time.perf_counter() - t0)


def predict(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  from jmem import measure  # pylint: disable=g-import-not-at-top
  try:
    on = measure.target(args.target)
  except measure.TargetError as e:
    print(f"benchmarks/gpu.py --predict: {e}", file=sys.stderr)
    return 2
  groups = _groups(args)
  out = dict(meta=_stamp(dict(target=on.name, target_label=on.label,
                              memory_limit=on.memory_limit,
                              limit_source=on.limit_source)), groups={})
  path = args.predicted or os.path.join(args.output_dir, f"{on.name}_target.json")
  if args.quick:
    path = path.replace(".json", "_quick.json")
  if args.groups or args.techniques:      # a part of the table: the rest stays as it was
    earlier = _predicted(path)
    if earlier.get("meta", {}).get("target") == on.name:
      out["groups"] = earlier.get("groups", {})
      out["meta"]["earlier_rows_from"] = {k: earlier["meta"].get(k)
                                          for k in ("commit", "date")}
  for gname, g in groups.items():
    rows = out["groups"].setdefault(gname, dict(config=g, rows={}))["rows"]
    for t in g["techniques"]:
      print(f"[{gname}] {t}: compiling for {on.short}", flush=True)
      try:
        rows[t] = predict_row(g, t, on)
      except Exception as e:  # pylint: disable=broad-except
        rows[t] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
      _ratios(rows)
      _write_predicted(out, path)
  print(f"wrote {path} and its .md")
  return 0


def _ratios(rows: dict) -> None:
  """Each row's max-batch multiplier: exact's per-example temp bytes over its own."""
  base = rows.get("exact", {}).get("per_example_temp_bytes")
  for row in rows.values():
    per = row.get("per_example_temp_bytes")
    row["max_batch_x"] = base / per if base and per and per > 0 else None


def _write_predicted(out: dict, path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  meta = out["meta"]
  lines = [f"# jmem's GPU table: memory for the {meta['target_label']}", "",
           "Written by `python benchmarks/gpu.py --predict` (no GPU needed). Each row: the "
           "whole AdamW train step of the model with the technique built as a user builds it "
           "(`jmem.convert(model, jmem.technique(name))`; ActNN at its bits everywhere, not "
           "calibrated), compiled for the target at two batch sizes (the slope: temp bytes one "
           "more example costs) and at the largest batch the line puts within the memory "
           f"limit, {meta['memory_limit']:,} bytes ({meta['limit_source']}): that compile "
           "confirms it fits.", ""]
  lines += [f"- {k}: {v}" for k, v in meta.items() if k not in ("target_label",)]
  for gname, gr in out["groups"].items():
    g = gr["config"]
    b0, b1 = g["batches"]
    lines += ["", f"## {gname}: {g['model']} {g['image']}²"
              + (f" x {g['frames']} frames" if g["frames"] else "") + f", {g['dtype']}"
              + (f", {g['overrides']}" if g["overrides"] else ""), "",
              f"| technique | temp GiB at {b0} | temp GiB at {b1} | MiB / example | "
              "max-batch x | largest batch (confirmed) | GFLOP / example (lowered) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for t, r in gr["rows"].items():
      if "error" in r:
        lines.append(f"| {t} | error: {r['error'][:150]} |")
        continue
      mb = r["max_batch"]
      conf = "" if r["max_batch_confirmed"] else " (not confirmed)"
      conf += " (some compiles with cuBLAS matrix products: see fallbacks)" if r.get(
          "fallbacks") else ""
      fl = "-" if not r.get("flops_lowered") else f"{r['flops_lowered'] / 1e9 / b0:.2f}"
      lines.append(f"| {t} | {r['memory'][str(b0)]['temp_bytes'] / 2**30:.3f} | "
                   f"{r['memory'][str(b1)]['temp_bytes'] / 2**30:.3f} | "
                   f"{r['per_example_temp_bytes'] / 2**20:.1f} | {_x(r.get('max_batch_x'))} | "
                   f"{mb if mb is not None else '-'}{conf} | {fl} |")
  with open(path.replace(".json", ".md"), "w") as f:
    f.write("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- workers

def worker_env(spec: dict) -> dict:
  """The environment: versions, device, memory limit (no compile)."""
  jax = _setup_jax()
  dev = jax.devices()[0]
  env = dict(backend=jax.default_backend(), device_kind=dev.device_kind, jax=jax.__version__,
             python=sys.version.split()[0])
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    env["jaxlib"] = jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    env["nvidia_smi"] = smi.stdout.strip()
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    if cuda_versions is not None:
      env["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
      env["cudnn"] = cuda_versions.cudnn_get_version()
  except Exception:  # pylint: disable=broad-except
    pass
  env["bytes_limit"] = (dev.memory_stats() or {}).get("bytes_limit")
  del spec
  return env


def worker_compile(spec: dict) -> dict:
  """One row compiled at both batch sizes, or at ``spec["batches"]`` (filling the persistent
  cache)."""
  out = {}
  for b in spec.get("batches") or spec["group"]["batches"]:
    t0 = time.perf_counter()
    step, abstract, x, y, _, _ = _build(spec["group"], spec["technique"], b)
    lowered = step.lower(abstract, x, y)
    out[str(b)] = dict(_memory(lowered.compile(), lowered), compile_s=time.perf_counter() - t0)
  return out


def _peak():
  import jax  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def worker_time(spec: dict) -> dict:
  """One row in a fresh process: its step at the larger batch (a cache hit), 3 warm-up
  steps, then the median of `TIMED_STEPS`; ``peak_bytes_in_use`` is this process's own."""
  import statistics  # pylint: disable=g-import-not-at-top
  jax = _setup_jax()
  group, b = spec["group"], spec["group"]["batches"][1]
  t0 = time.perf_counter()
  step, abstract, x, y, make_state, make_batch = _build(group, spec["technique"], b)
  compiled = step.lower(abstract, x, y).compile()
  out = dict(load_or_compile_s=time.perf_counter() - t0)
  state, (xb, yb) = make_state(), make_batch()
  for _ in range(3):
    state, metrics = compiled(state, xb, yb)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(spec.get("steps", TIMED_STEPS)):
    t = time.perf_counter()
    state, metrics = compiled(state, xb, yb)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t)
  out.update(step_time_s=statistics.median(times), step_time_min_s=min(times),
             loss_finite=bool(jax.numpy.isfinite(metrics["loss"])))
  out["peak_bytes_in_use"], out["bytes_limit"] = _peak()
  return out


def worker_kernels(spec: dict) -> dict:
  """The Pallas kernels' bandwidth against their XLA paths (quantize+pack, unpack+
  dequantize), as bytes moved per second and fractions of a device copy and of HBM."""
  jax = _setup_jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem.ops.actnn import quantize as Q  # pylint: disable=g-import-not-at-top

  def timed(f, *a, repeats=20):
    for _ in range(3):
      jax.block_until_ready(f(*a))
    t0 = time.perf_counter()
    out = None
    for _ in range(repeats):
      out = f(*a)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats
  n = spec["values"]
  x = jax.random.normal(jax.random.key(0), (n // 65536, 65536), jnp.float32)
  copy_t = timed(jax.jit(lambda v: v * 2.0), x)
  copy_bw = 8 * n / copy_t
  rows = [dict(op="copy x*2 (XLA)", dtype="float32", implementation="xla", time_s=copy_t,
               bytes=8 * n, bandwidth=copy_bw)]
  key = jax.random.key(2)
  for dtype in ("float32", "bfloat16"):
    xd, isz = x.astype(dtype), jnp.dtype(dtype).itemsize
    for bits in spec["bits"]:
      meta = n // 256 * 6
      for impl in ("xla", "pallas"):
        qf = jax.jit(lambda v, b=bits, i=impl: Q.quantize(v, key, bits=b, implementation=i))
        qx = qf(xd)
        df = jax.jit(lambda c, b=bits, i=impl, d=dtype: Q.dequantize(
            c, xd.shape, d, bits=b, implementation=i))
        for op, f, arg, nbytes in (
            ("quantize+pack", qf, xd, n * isz + n * bits // 8 + meta),
            ("unpack+dequantize", df, qx, n * bits // 8 + meta + n * isz)):
          t = timed(f, arg)
          rows.append(dict(op=f"{op} {bits}-bit", dtype=dtype, implementation=impl, time_s=t,
                           bytes=nbytes, bandwidth=nbytes / t))
  kind = jax.devices()[0].device_kind
  nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in kind), None)
  for r in rows:
    r["fraction_of_copy"] = r["bandwidth"] / copy_bw
    r["fraction_of_nominal"] = None if nominal is None else r["bandwidth"] / nominal
  return dict(rows=rows, copy_bandwidth=copy_bw, nominal_bandwidth=nominal)


WORKERS = {"env": worker_env, "compile": worker_compile, "time": worker_time,
           "kernels": worker_kernels}


def _worker_main(kind: str, spec_path: str, out_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  try:
    result = {"ok": True, "result": WORKERS[kind](spec)}
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}",
              "traceback": traceback.format_exc()[-3000:]}
  with open(out_path, "w") as f:
    json.dump(result, f)


def _worker_env(allow_cpu: bool, cache_dir: str) -> dict[str, str]:
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.90"     # the H100 target's limit was read so
  env["JMEM_GPU_BENCH_CACHE"] = cache_dir
  env["PYTHONUNBUFFERED"] = "1"
  if allow_cpu:
    env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
  return env


class Runner:
  """Starts worker processes (each a fresh Python) and keeps the time budget."""

  def __init__(self, args, cache_dir: str, tmp: str):
    self.args, self.cache_dir, self.tmp = args, cache_dir, tmp
    self.start = time.perf_counter()
    self.log_lines: list[str] = []
    self._count = 0
    self._lock = threading.Lock()

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.args.time_budget - self.elapsed()

  def log(self, msg: str) -> None:
    line = f"[{self.elapsed():6.1f}s] {msg}"
    self.log_lines.append(line)
    print(line, flush=True)

  def run(self, kind: str, spec: dict, timeout: float) -> dict:
    with self._lock:
      self._count += 1
      n = self._count
    spec_path = os.path.join(self.tmp, f"spec{n}.json")
    out_path = os.path.join(self.tmp, f"out{n}.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    timeout = max(5.0, timeout)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", kind, spec_path, out_path],
        env=_worker_env(self.args.allow_cpu, self.cache_dir), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
      _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.communicate()
      return {"ok": False, "error": f"{NOT_MEASURED}: worker {kind} stopped after "
                                    f"{timeout:.0f} s"}
    if not os.path.exists(out_path):
      return {"ok": False, "error": f"worker {kind} exited {proc.returncode} without a result",
              "stderr": stderr[-2000:]}
    with open(out_path) as f:
      res = json.load(f)
    res["seconds"] = time.perf_counter() - t0
    return res


def _groups(args) -> dict:
  groups = QUICK_GROUPS if args.quick else GROUPS
  if args.groups:
    wanted = args.groups.split(",")
    unknown = [g for g in wanted if g not in groups]
    if unknown:
      raise SystemExit(f"benchmarks/gpu.py: unknown groups {unknown}; these are "
                       f"{', '.join(groups)}.")
    groups = {k: v for k, v in groups.items() if k in wanted}
  if args.techniques:
    wanted = args.techniques.split(",")
    groups = {k: dict(v, techniques=tuple(t for t in v["techniques"] if t in wanted))
              for k, v in groups.items()}
  return groups


def _predicted(path: str) -> dict:
  """The committed H100-target predictions (`predict`), or {} where there are none."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def orchestrate(args) -> int:
  groups = _groups(args)
  tmp = tempfile.mkdtemp(prefix="jmem_gpu_")
  r = Runner(args, os.path.join(tmp, "xla_cache"), tmp)
  res = r.run("env", {}, timeout=120)
  if not res.get("ok"):
    print(f"benchmarks/gpu.py: reading the environment failed, so nothing was measured: "
          f"{res.get('error')}\n{res.get('traceback', '')}{res.get('stderr', '')}",
          file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1
  env = res["result"]
  if env["backend"] != "gpu" and not args.allow_cpu:
    print(f"benchmarks/gpu.py: no GPU here (JAX backend {env['backend']!r}); nothing to "
          "measure. Run it on a machine with an NVIDIA GPU (--predict compiles for one from "
          "here; --allow-cpu --quick checks the pipeline).")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0
  predicted_path = args.predicted or (PREDICTED.replace(".json", "_quick.json")
                                      if args.quick else PREDICTED)
  predicted = _predicted(predicted_path)
  results = dict(meta=_stamp(env), predicted_from=dict(
      predicted.get("meta", {}), path=os.path.relpath(predicted_path, os.path.dirname(HERE))),
                 groups={}, log=r.log_lines)
  for gname, g in groups.items():
    results["groups"][gname] = dict(config=g, rows={t: {} for t in g["techniques"]})
    for t in g["techniques"]:
      p = predicted.get("groups", {}).get(gname, {}).get("rows", {}).get(t)
      if p and "memory" in p:
        results["groups"][gname]["rows"][t]["predicted"] = dict(
            memory=p["memory"], per_example_temp_bytes=p["per_example_temp_bytes"],
            max_batch=p.get("max_batch"))
  stem = os.path.join(args.output_dir, f"gpu_{_slug(env.get('device_kind', 'unknown'))}_"
                      f"{datetime.date.today().isoformat()}" + ("_quick" if args.quick else ""))
  lock = threading.Lock()

  def save():
    with lock:
      results["wall_s"] = r.elapsed()
      _write(results, stem)

  # Phase 1: every row compiled at both batch sizes, in parallel, filling the cache.
  rows = [(gname, t) for gname, g in groups.items() for t in g["techniques"]]
  until = args.time_budget * COMPILE_SHARE
  r.log(f"compiling {len(rows)} rows in {args.jobs} processes, by {until:.0f} s")

  def compile_row(key):
    gname, t = key
    row = results["groups"][gname]["rows"][t]
    batches = groups[gname]["batches"]
    out = r.run("compile", dict(group=groups[gname], technique=t,
                                batches=batches[1:] if args.timed_batch_only else None),
                timeout=until - r.elapsed())
    if out.get("ok"):
      row["compiled"] = out["result"]
      if not args.timed_batch_only:
        row.update(_slope(out["result"], batches))
      elif "predicted" in row:       # the slope is the H100 target's, and says so
        row.update(per_example_temp_bytes=row["predicted"]["per_example_temp_bytes"],
                   slope_from="prediction")
      r.log(f"{gname} {t}: compiled in {out['seconds']:.0f} s")
    else:
      row["error"] = out.get("error")
      r.log(f"{gname} {t}: compile failed: {out.get('error')} {out.get('stderr', '')[-300:]}")
    save()
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    list(pool.map(compile_row, rows))
  # Phase 2: each row timed in a fresh process, one at a time.
  until = args.time_budget * TIME_SHARE
  for gname, t in rows:
    row = results["groups"][gname]["rows"][t]
    if "compiled" not in row:
      continue
    if r.elapsed() > until - 15:
      row["run"] = dict(error=NOT_MEASURED)
      continue
    out = r.run("time", dict(group=groups[gname], technique=t), timeout=until - r.elapsed())
    row["run"] = out.get("result") if out.get("ok") else dict(error=out.get("error"))
    run = row["run"]
    r.log(f"{gname} {t}: " + (f"{1e3 * run['step_time_s']:.1f} ms, peak "
                              f"{_gib(run.get('peak_bytes_in_use'))} GiB"
                              if "step_time_s" in run else str(run.get("error"))))
    _vs_exact(results["groups"][gname]["rows"], groups[gname]["batches"])
    save()
  # Then the kernels' bandwidth, with what is left.
  if r.left() > 45:
    r.log("the Pallas kernels' bandwidth")
    out = r.run("kernels", dict(values=2**16 * (16 if args.quick else 4096),
                                bits=(2,) if args.quick else (2, 4)), timeout=r.left() - 5)
    results["kernels"] = out.get("result") if out.get("ok") else dict(error=out.get("error"))
  else:
    results["kernels"] = dict(error=NOT_MEASURED)
  r.log("done")
  save()
  print(f"wrote {stem}.{{json,md}}")
  shutil.rmtree(tmp, ignore_errors=True)
  return 0


def _vs_exact(rows: dict, batches) -> None:
  """Each row's figures as ratios to exact's (measured in the same run)."""
  base = rows.get("exact", {})
  b = str(batches[1])

  def ratio(row, get):
    try:
      num, den = get(row), get(base)
    except (KeyError, TypeError):
      return None
    return None if num is None or not den else num / den
  for row in rows.values():
    if "compiled" not in row:
      continue
    row["vs_exact"] = dict(
        step_time=ratio(row, lambda r: r["run"]["step_time_s"]),
        peak_bytes_in_use=ratio(row, lambda r: r["run"]["peak_bytes_in_use"]),
        temp_bytes=ratio(row, lambda r: r["compiled"][b]["temp_bytes"]),
        max_batch=(base["per_example_temp_bytes"] / row["per_example_temp_bytes"]
                   if base.get("per_example_temp_bytes") and
                   row.get("per_example_temp_bytes", 0) > 0 else None))


def _stamp(extra: dict) -> dict:
  """Commit, date, versions, device and target every result file names (`_common.stamp`),
  without touching a backend in this process: the device is the workers' (``device_kind``),
  or none where the steps are compiled for a target."""
  extra = {k: v for k, v in extra.items() if k not in ("jax", "jaxlib")}
  device = extra.get("device_kind") or "CPU (compile only)"
  return _common.stamp(extra.pop("target", None) or device, device=device, **extra)


def _slug(kind: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in kind.lower()).strip("_") or "unknown"


def _x(ratio) -> str:
  return "-" if ratio is None else f"{ratio:.2f}"


def _gib(b) -> str:
  return "-" if b is None else f"{b / 2**30:.3f}"


def _write(results: dict, stem: str) -> None:
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1, default=str)
  meta = results["meta"]
  pred = results.get("predicted_from") or {}
  lines = [f"# jmem on {meta.get('device_kind')}", "",
           f"Written by `python benchmarks/gpu.py` in {results.get('wall_s', 0):.0f} s. Each "
           "row's step is compiled on this device (temp bytes at both batch sizes, the slope), "
           f"then run in a fresh process: the median of {TIMED_STEPS} steps at the larger batch "
           "and `peak_bytes_in_use`. Beside them, the H100 target's prediction of the temp "
           "bytes, compiled without a GPU"
           + (f" (`{pred.get('path')}`, commit {pred.get('commit')}, jaxlib "
              f"{pred.get('jaxlib')})" if pred.get("commit") else
              " (none committed: run `benchmarks/gpu.py --predict`)") + ".", ""]
  if any(row.get("slope_from") == "prediction" for gr in results["groups"].values()
         for row in gr["rows"].values()):
    lines += ["Run with `--timed-batch-only`: each step was compiled here at the timed batch "
              "alone, so a \"MiB / example\" marked (H100 target) is the prediction's slope.",
              ""]
  lines += [f"- {k}: {v}" for k, v in meta.items()]
  for gname, gr in results["groups"].items():
    g = gr["config"]
    b0, b1 = g["batches"]
    lines += ["", f"## {gname}: {g['model']} {g['image']}²"
              + (f" x {g['frames']} frames" if g["frames"] else "") + f", {g['dtype']}", "",
              f"| technique | step ms (batch {b1}) | step / exact | loss finite | peak in use "
              f"GiB | temp GiB at {b0} (predicted) | temp GiB at {b1} (predicted) | "
              "MiB / example | max-batch x |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for t, row in gr["rows"].items():
      if "compiled" not in row:
        lines.append(f"| {t} | {row.get('error', NOT_MEASURED)[:150]} |")
        continue
      run, vs = row.get("run", {}), row.get("vs_exact", {})
      p = row.get("predicted", {}).get("memory", {})
      step = (f"{1e3 * run['step_time_s']:.1f}" if "step_time_s" in run
              else str(run.get("error", "-"))[:80])
      cell = lambda b: (f"{_gib(row['compiled'].get(str(b), {}).get('temp_bytes'))} "
                        f"({_gib(p.get(str(b), {}).get('temp_bytes'))})")
      per = row.get("per_example_temp_bytes")
      per = "-" if per is None else f"{per / 2**20:.1f}" + (
          " (H100 target)" if row.get("slope_from") == "prediction" else "")
      lines.append(f"| {t} | {step} | {_x(vs.get('step_time'))} | "
                   f"{run.get('loss_finite', '-')} | {_gib(run.get('peak_bytes_in_use'))} | "
                   f"{cell(b0)} | {cell(b1)} | {per} | {_x(vs.get('max_batch'))} |")
  k = results.get("kernels") or {}
  if k.get("rows"):
    lines += ["", "## Kernels", "", f"Copy bandwidth: {k['copy_bandwidth'] / 1e9:.0f} GB/s; "
              f"nominal HBM: {k['nominal_bandwidth']}.", "",
              "| op | dtype | implementation | time (ms) | GB/s | / copy | / nominal |",
              "|---|---|---|---:|---:|---:|---:|"]
    for row in k["rows"]:
      lines.append(f"| {row['op']} | {row['dtype']} | {row['implementation']} | "
                   f"{1e3 * row['time_s']:.3f} | {row['bandwidth'] / 1e9:.0f} | "
                   f"{row['fraction_of_copy']:.2f} | {_x(row['fraction_of_nominal'])} |")
  lines += ["", "## Log", "", "```"] + results["log"] + ["```", ""]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--predict", action="store_true",
                 help="compile every row for the H100 target on this machine (no GPU)")
  p.add_argument("--target", default="h100", help="the target of --predict")
  p.add_argument("--predicted", default="",
                 help=f"the predictions file (default {os.path.relpath(PREDICTED)})")
  p.add_argument("--output-dir", default=RESULTS)
  p.add_argument("--time-budget", type=float, default=540.0,
                 help="seconds (on a GPU); what does not fit is written as not measured")
  p.add_argument("--jobs", type=int, default=max(1, min(6, (os.cpu_count() or 2) // 3)),
                 help="parallel compile processes")
  p.add_argument("--groups", default="", help="comma-separated subset of the groups")
  p.add_argument("--techniques", default="", help="comma-separated subset of the techniques")
  p.add_argument("--quick", action="store_true", help="tiny shapes (a pipeline check)")
  p.add_argument("--timed-batch-only", action="store_true",
                 help="compile each row at the timed batch only (half the compiles); its "
                      "per-example slope is then the committed H100-target prediction's")
  p.add_argument("--allow-cpu", action="store_true",
                 help="run the GPU pipeline on a CPU (with --quick: check it)")
  p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    _worker_main(*args.worker)
    return 0
  if args.predict:
    return predict(args)
  return orchestrate(args)


if __name__ == "__main__":
  sys.exit(main())
