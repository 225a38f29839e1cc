"""Every GPU figure jmem reports, in one command.

  python benchmarks/gpu.py [--output-dir benchmarks/results] [--time-budget 570]

On a machine without a GPU it prints why it skips and exits 0 (``--allow-cpu --quick`` runs
the same pipeline on tiny shapes, to check it without a GPU). On a GPU it writes
``gpu_<device>.json`` and ``gpu_<device>.md`` with:

* Kernel bandwidth: the Pallas quantize+pack / unpack+dequantize kernels, the InPlace-ABN
  kernels and SyncBN's statistics kernel (`jmem._backends.BN_MOMENTS`, alone and inside
  `jmem.parallel.sync_bn.sync_batch_norm`) against their XLA paths, as bytes moved per
  second and as a fraction of the device's HBM bandwidth (nominal, and measured by a
  device-to-device copy); each memory-bound Pallas kernel is marked as meeting the goal of
  80% of the nominal HBM bandwidth or not.
* Train steps of ResNet-50 at 224² (float32 and bfloat16) and of the video models: step
  time (interleaved with exact, in the same process), ``peak_bytes_in_use`` (each
  technique run before any larger one, so the peak is its own), compiled temp bytes, and
  each of these and the predicted largest batch as a ratio to exact's in the same run.
* The largest batch of each technique: predicted from the compiled memory at two batch
  sizes (the slope is what one more example costs) and the device's memory limit, then
  confirmed by running a step at the prediction (must fit) and 10% above (must not).
* JAX, jaxlib, CUDA and driver versions.

Which techniques: every name in jmem's technique registry (`jmem.techniques`, what ``jmem
bench --techniques`` takes), each implementation of one with kernels (``actnn-L3:xla``,
``actnn-L3:pallas``, ...), whose ``apply`` takes the group's model, less the group's
``exclude`` patterns. So a stack (two techniques combined), once registered as a technique,
is measured here with no change to this script (the named policies ``recompute-2bit``,
``offload`` and ``offload-2bit`` are). Techniques that
need several devices (``spatial-8``) or another kind of model (SBP on a ResNet, ActNN on a
video model) do not apply and are listed as such in the output.

How it stays under 10 minutes: every step is compiled once, in parallel worker processes
that fill a persistent compilation cache; the processes that measure (one per model and
dtype, one per max-batch check, so that ``peak_bytes_in_use`` is never another run's) load
the compiled steps from that cache. Everything runs in priority order (`PRIORITY`: exact,
then the headline techniques, then the rest) against ``--time-budget``: compiling stops at
`COMPILE_SHARE` of it, measuring at `MEASURE_SHARE`, and the max-batch checks take what is
left, so what does not fit is the lowest-priority work, and it is written as "not measured
(time budget)" or "not confirmed (time budget)", never left out silently.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# name -> model, example shape builder args, dtype, timing batch, model overrides, and which
# registered techniques it measures: all that apply to the model, less ``exclude`` (fnmatch
# patterns over names such as "actnn-L3:xla"), or only ``only`` where given (quick mode).
# The timing batch B is also the second slope point; the first is B / 2.
GROUPS = {
    "resnet50-f32": dict(model="resnet50", image=224, frames=None, dtype="float32", batch=64,
                         overrides={}, exclude=()),
    "resnet50-bf16": dict(model="resnet50", image=224, frames=None, dtype="bfloat16", batch=64,
                          overrides={}, exclude=()),
    "video-vit": dict(model="video-vit", image=112, frames=16, dtype="float32", batch=16,
                      overrides=dict(patch=16, dim=384, depth=8, heads=6, exact_last=2),
                      exclude=()),
    "stt-resnet8": dict(model="stt-resnet8", image=64, frames=16, dtype="float32", batch=32,
                        overrides={}, exclude=()),
}
# Quick mode (a pipeline check on CPU): one technique of each kind, so each code path runs
# (each is compiled at four batch sizes and run in two more processes: few, to keep it quick).
QUICK_GROUPS = {
    "resnet8-f32": dict(model="resnet8", image=16, frames=None, dtype="float32", batch=8,
                        overrides={}, exclude=(),
                        only=("exact", "remat", "actnn-L3:pallas", "inplace-abn:pallas",
                              "sync-bn:pallas")),
    "video-vit": dict(model="video-vit", image=24, frames=4, dtype="float32", batch=4,
                      overrides={}, exclude=(), only=("exact", "sbp-0.25")),
}
# Compiled, measured and confirmed first (across groups: every group's exact, then every
# group's actnn-L3:pallas, ...); techniques not named here follow in registry order.
PRIORITY = ("exact", "actnn-L3:pallas", "inplace-abn:pallas", "remat", "sbp-0.25",
            "actnn-L2:pallas", "actnn-L4:pallas", "actnn-L5:pallas", "actnn-L1:pallas",
            "sync-bn:pallas", "inplace-abn:xla", "actnn-L3:xla", "sbp-0.5", "sbp-0.125",
            "recompute-2bit:pallas", "offload", "offload-2bit:pallas")
# Fractions of --time-budget by which compiling, then measuring, must end.
COMPILE_SHARE = 0.45
MEASURE_SHARE = 0.80
# The memory-bound kernels' goal: this fraction of the device's nominal HBM bandwidth.
BANDWIDTH_GOAL = 0.80
# Nominal HBM bandwidth, bytes/s, by device kind (vendor data sheets).
NOMINAL_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12,
                     "H200": 4.8e12, "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12}
# The memory limit the max batch is predicted for off the GPU (--allow-cpu).
CPU_LIMIT = 2**26
NOT_MEASURED = "not measured (time budget)"
NOT_CONFIRMED = "not confirmed (time budget)"


def _rank(technique: str) -> int:
  return PRIORITY.index(technique) if technique in PRIORITY else len(PRIORITY)


# ----------------------------------------------------------------------------- workers

def _worker_env(allow_cpu: bool, cache_dir: str, preallocate: bool) -> dict[str, str]:
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
  env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.90"
  env["JMEM_GPU_BENCH_CACHE"] = cache_dir
  env["PYTHONUNBUFFERED"] = "1"
  if allow_cpu:
    env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
  return env


def _setup_jax():
  import jax  # pylint: disable=g-import-not-at-top
  cache = os.environ.get("JMEM_GPU_BENCH_CACHE")
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return jax


def _build(group: dict, technique: str, batch: int):
  """``(step, abstract_state, x_spec, y_spec, make_state, make_batch)`` for one config."""
  jax = _setup_jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import bench, models, train  # pylint: disable=g-import-not-at-top
  dtype = jnp.dtype(group["dtype"])
  overrides = dict(group["overrides"])
  if group["frames"] is None:
    overrides["dtype"] = dtype
    shape = (group["image"], group["image"], 1 if group["image"] < 32 else 3)
  else:
    shape = (group["frames"], group["image"], group["image"], 1)
  base = models.create_model(group["model"], 10, **overrides)
  tech = bench.get_technique(technique)
  # apply, not prepare: ActNN L3-L5 at 2 bits everywhere (a calibrated allocation has the
  # same average, so the same memory and nearly the same time).
  model = tech.apply(base, **({"implementation": tech.implementation} if tech.has_kernels
                              else {}))
  fns = train.model_fns(model)
  optimizer = train.default_optimizer(1e-3, 1000)
  x_spec = jax.ShapeDtypeStruct((batch,) + shape, jnp.float32)
  y_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
  one = jax.ShapeDtypeStruct((1,) + shape, jnp.float32)
  abstract = jax.eval_shape(lambda k, x: train.init_state(fns, optimizer, k, x),
                            jax.random.key(0), one)
  step = train.make_train_step(fns, optimizer, donate=True)

  def make_state():
    return jax.jit(lambda k: train.init_state(fns, optimizer, k, jnp.zeros(one.shape)))(
        jax.random.key(0))

  def make_batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return (jax.random.normal(kx, x_spec.shape, jnp.float32),
            jax.random.randint(ky, (batch,), 0, 10, jnp.int32))
  return step, abstract, x_spec, y_spec, make_state, make_batch


def worker_plan(spec: dict) -> dict:
  """Each group's techniques from the registry: every registered name (each implementation
  of one with kernels) whose ``apply`` takes the group's model, in registry order."""
  _setup_jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import _backends, bench, models  # pylint: disable=g-import-not-at-top
  from jmem._technique import IMPLEMENTATIONS  # pylint: disable=g-import-not-at-top
  out = {}
  for gname, group in spec["groups"].items():
    overrides = dict(group["overrides"])
    if group["frames"] is None:
      overrides["dtype"] = jnp.dtype(group["dtype"])
    base = models.create_model(group["model"], 10, **overrides)
    applies, not_applicable, excluded = [], {}, []
    for name in bench.technique_names():
      record = bench.get_technique(name)
      names = ([f"{name}:{i}" for i in _backends.implementations(*record.kernel_ops)]
               if record.has_kernels and record.kernel_ops else
               [f"{name}:{i}" for i in IMPLEMENTATIONS] if record.has_kernels else [name])
      for full in names:
        if group.get("only") is not None and full not in group["only"]:
          continue
        if any(fnmatch.fnmatchcase(full, p) for p in group["exclude"]):
          excluded.append(full)
          continue
        tech = bench.get_technique(full)
        try:
          tech.apply(base, **({"implementation": tech.implementation} if tech.has_kernels
                              else {}))
        except (ValueError, TypeError) as e:
          not_applicable[full] = f"{type(e).__name__}: {str(e)[:200]}"
          continue
        applies.append(full)
    out[gname] = dict(techniques=applies, not_applicable=not_applicable, excluded=excluded)
  return out


def _compile(group, technique, batch):
  t0 = time.perf_counter()
  step, abstract, x_spec, y_spec, make_state, make_batch = _build(group, technique, batch)
  lowered = step.lower(abstract, x_spec, y_spec)
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  return compiled, seconds, make_state, make_batch, lowered


def _memory(compiled, lowered=None) -> dict:
  m = compiled.memory_analysis()
  out = dict(temp_bytes=int(m.temp_size_in_bytes), argument_bytes=int(m.argument_size_in_bytes),
             output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes))
  out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] +
                        out["temp_bytes"])
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    out["flops"] = float(cost.get("flops", 0.0))
  except Exception:  # pylint: disable=broad-except
    out["flops"] = None
  # The compiled module's count omits library calls on a GPU (cuDNN convolutions:
  # jmem.measure.step_flops); the lowered module's has them (one device: not divided).
  from jmem import measure  # pylint: disable=g-import-not-at-top
  out["flops_lowered"] = None if lowered is None else measure.lowered_flops(lowered)
  return out


def worker_compile(spec: dict) -> dict:
  """Compiles one technique at the given batch sizes; memory figures per batch."""
  res = {}
  for batch in spec["batches"]:
    compiled, seconds, _, _, lowered = _compile(spec["group"], spec["technique"], batch)
    res[str(batch)] = dict(_memory(compiled, lowered), compile_s=seconds)
  return res


def _is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def _peak():
  import jax  # pylint: disable=g-import-not-at-top
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def worker_measure(spec: dict) -> dict:
  """One model and dtype: each technique's peak (in ascending order of its compiled peak,
  so the running maximum is its own), then step times interleaved with exact."""
  jax = _setup_jax()
  from jmem import measure  # pylint: disable=g-import-not-at-top
  group, batch = spec["group"], spec["batch"]
  out: dict = {}
  runners = {}
  # Peaks take ~60% of this group's share of the time, timing the rest. A technique is run
  # only if, at the mean time per technique so far, it and every higher-priority one still
  # to come fit in that: what the time budget drops is the lowest-priority work.
  start, share, done = time.perf_counter(), 0.6 * spec["seconds"], 0
  order = spec["order"]
  for i, technique in enumerate(order):
    row = out.setdefault(technique, {})
    elapsed = time.perf_counter() - start
    if done and technique != "exact":   # exact always: every ratio is against it
      ahead = sum(_rank(t) < _rank(technique) for t in order[i + 1:])
      if elapsed + elapsed / done * (1 + ahead) > share:
        row["not_measured"] = NOT_MEASURED
        continue
    done += 1
    try:
      compiled, seconds, make_state, make_batch, _ = _compile(group, technique, batch)
      row["load_or_compile_s"] = seconds
      state, (x, y) = make_state(), make_batch()
      before, _ = _peak()
      for _ in range(3):
        state, metrics = compiled(state, x, y)
      jax.block_until_ready(metrics)
      row["peak_bytes_in_use"], row["bytes_limit"] = _peak()
      row["peak_is_own"] = before is None or row["peak_bytes_in_use"] > before
      row["loss_finite"] = bool(jax.numpy.isfinite(metrics["loss"]))
      del state
      runners[technique] = (compiled, make_state, x, y)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  steps = {}
  for technique, (compiled, make_state, x, y) in runners.items():
    holder = {"state": make_state()}

    def run(compiled=compiled, holder=holder, x=x, y=y):
      holder["state"], metrics = compiled(holder["state"], x, y)
      return metrics
    steps[technique] = run
  if "exact" in steps:
    times = measure.time_steps(steps, warmup=2, repeats=spec["repeats"], baseline="exact")
    for technique, t in times.items():
      out[technique].update(step_time_s=t["median_s"], step_time_min_s=t["min_s"],
                            step_time_ratio=t["ratio"])
  return out


def worker_confirm(spec: dict) -> dict:
  """Runs a step at the predicted largest batch (must fit) and 10% above (must not)."""
  jax = _setup_jax()
  out = {}
  for label, batch in (("at_prediction", spec["batch"]), ("above", spec["above"])):
    row = out.setdefault(label, {"batch": batch})
    try:
      compiled, _, make_state, make_batch, _ = _compile(spec["group"], spec["technique"], batch)
      state, (x, y) = make_state(), make_batch()
      for _ in range(2):
        state, metrics = compiled(state, x, y)
      jax.block_until_ready(metrics)
      row["fits"] = True
      row["peak_bytes_in_use"], row["bytes_limit"] = _peak()
      del state, x, y, metrics
    except Exception as e:  # pylint: disable=broad-except
      row["fits"] = False
      row["oom"] = _is_oom(e)
      if not row["oom"]:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
  return out


def _time(f, *args, repeats=20):
  import jax  # pylint: disable=g-import-not-at-top
  for _ in range(3):
    jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  out = None
  for _ in range(repeats):     # one output alive at a time (the inputs reach 1 GiB)
    out = f(*args)
  jax.block_until_ready(out)   # one stream: the last done means all done
  return (time.perf_counter() - t0) / repeats


def worker_kernels(spec: dict) -> dict:
  """Kernel timings (and the environment: versions, device, memory limit)."""
  jax = _setup_jax()
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jmem import _backends  # pylint: disable=g-import-not-at-top
  from jmem.ops import inplace_abn as abn  # pylint: disable=g-import-not-at-top
  from jmem.ops.actnn import quantize as Q  # pylint: disable=g-import-not-at-top
  from jmem.parallel import sync_bn  # pylint: disable=g-import-not-at-top
  dev = jax.devices()[0]
  env = dict(backend=jax.default_backend(), device_kind=dev.device_kind,
             jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__")
             else None, python=sys.version.split()[0])
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    env["jaxlib"] = jaxlib.__version__
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    env["nvidia_smi"] = smi.stdout.strip()
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    for line in head.splitlines():
      if "CUDA Version" in line:
        env["cuda_driver_api"] = line.split("CUDA Version:")[1].split()[0]
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
  if env["backend"] != "gpu" and not spec["allow_cpu"]:
    return {"env": env}
  n = spec["values"]
  rows = []
  x = jax.random.normal(jax.random.key(0), (n // 65536, 65536), jnp.float32)
  copy = jax.jit(lambda v: v * 2.0)
  t = _time(copy, x)
  copy_bw = 8 * n / t
  rows.append(dict(op="copy x*2 (XLA)", dtype="float32", implementation="xla", time_s=t,
                   bytes=8 * n, bandwidth=copy_bw))
  key = jax.random.key(2)
  checks, bn_checks = [], []
  for dtype in ("float32", "bfloat16"):
    xd = x.astype(dtype)
    isz = jnp.dtype(dtype).itemsize
    for bits in spec["bits"]:
      group = 256
      meta = n // group * 6
      for impl in ("xla", "pallas"):
        qf = jax.jit(lambda v, b=bits, i=impl: Q.quantize(v, key, bits=b, group_size=group,
                                                           implementation=i))
        qx = qf(xd)
        df = jax.jit(lambda c, b=bits, i=impl, d=dtype: Q.dequantize(
            c, xd.shape, d, bits=b, group_size=group, implementation=i))
        if impl == "pallas":   # the kernels agree with the XLA path on this device
          ref = Q.quantize(xd, key, bits=bits, group_size=group, implementation="xla")
          same = float(jnp.mean(qx.codes == ref.codes))
          back = Q.dequantize(qx, xd.shape, dtype, bits=bits, group_size=group,
                              implementation="xla")
          step = (jnp.max(xd.astype(jnp.float32)) - jnp.min(xd.astype(jnp.float32))) / (2**bits - 1)
          err = float(jnp.max(jnp.abs(back.astype(jnp.float32) - df(qx).astype(jnp.float32))))
          checks.append(dict(dtype=dtype, bits=bits, codes_identical_fraction=same,
                             minimum_identical=bool(jnp.array_equal(qx.minimum, ref.minimum)),
                             scale_identical_fraction=float(jnp.mean(qx.scale == ref.scale)),
                             dequantize_max_abs_difference=err,
                             mean_abs_error_over_step=float(jnp.mean(jnp.abs(
                                 back.astype(jnp.float32) - xd.astype(jnp.float32)))
                                 / step)))
        for op, f, arg, nbytes in (
            ("quantize+pack", qf, xd, n * isz + n * bits // 8 + meta),
            ("unpack+dequantize", df, qx, n * bits // 8 + meta + n * isz)):
          t = _time(f, arg)
          rows.append(dict(op=f"{op} {bits}-bit", dtype=dtype, implementation=impl, time_s=t,
                           bytes=nbytes, bandwidth=nbytes / t, memory_bound=True))
  # Partial blocks (5 samples x 2 groups = 10 rows of a 32-row block): the case an unmasked
  # kernel gets wrong on a GPU while interpret mode pads it silently.
  for shape in ((5, 300), (33, 256), (7, 3, 5, 64)):
    xp = jax.random.normal(jax.random.key(4), shape) * 3 + 1
    a = Q.quantize(xp, key, bits=2, implementation="xla")
    b = Q.quantize(xp, key, bits=2, implementation="pallas")
    back = Q.dequantize(b, shape, xp.dtype, bits=2, implementation="pallas")
    step = (jnp.max(xp) - jnp.min(xp)) / 3
    checks.append(dict(dtype=f"float32 {shape} (partial block)", bits=2,
                       codes_identical_fraction=float(jnp.mean(a.codes == b.codes)),
                       minimum_identical=bool(jnp.array_equal(a.minimum, b.minimum)),
                       scale_identical_fraction=float(jnp.mean(a.scale == b.scale)),
                       dequantize_max_abs_difference=float(jnp.max(jnp.abs(
                           back - Q.dequantize(a, shape, xp.dtype, bits=2,
                                               implementation="xla")))),
                       mean_abs_error_over_step=float(jnp.mean(jnp.abs(back - xp)) / step)))
  shape = spec["abn_shape"]
  m = 1
  for d in shape:
    m *= d
  c = shape[-1]
  scale, bias = jnp.ones((c,)), jnp.zeros((c,))
  for dtype in ("float32", "bfloat16"):
    xa = jax.random.normal(jax.random.key(3), shape, jnp.float32).astype(dtype) * 3 + 1
    ct = jnp.ones(shape, dtype)
    isz = jnp.dtype(dtype).itemsize
    for impl in ("xla", "pallas"):
      fwd = jax.jit(lambda v, i=impl: abn.inplace_abn(v, scale, bias, implementation=i)[0])

      def fwd_bwd(v, i=impl):
        z, vjp = jax.vjp(lambda u: abn.inplace_abn(u, scale, bias, implementation=i)[0], v)
        return z, vjp(ct)[0]
      fb = jax.jit(fwd_bwd)
      # Bytes the kernels must move: forward reads x twice (statistics, then normalise) and
      # writes z; backward reads z and dz twice (sums, then dx) and writes dx.
      for op, f, nbytes in (("InPlace-ABN forward", fwd, 3 * m * isz),
                            ("InPlace-ABN forward+backward", fb, 3 * m * isz + 5 * m * isz)):
        t = _time(f, xa)
        rows.append(dict(op=op, dtype=dtype, implementation=impl, time_s=t, bytes=nbytes,
                         bandwidth=nbytes / t, memory_bound=True))
    # SyncBN's statistics (`jmem._backends.BN_MOMENTS`; "pallas" is
    # `pallas_kernels.inplace_abn.moments`): the moments alone read x once; the whole
    # forward of `sync_batch_norm` reads x for the moments, then again to normalise, and
    # writes y.
    outs = {}
    for impl in _backends.implementations(_backends.BN_MOMENTS):
      mom = jax.jit(lambda v, i=impl: tuple(_backends.get(_backends.BN_MOMENTS, i)(v)
                                            .stats()))   # mean, variance, count
      sbn = jax.jit(lambda v, i=impl: sync_bn.sync_batch_norm(v, scale, bias,
                                                              implementation=i)[0])
      for op, f, nbytes in (("BN moments (SyncBN statistics)", mom, m * isz),
                            ("SyncBN forward (sync_batch_norm)", sbn, 3 * m * isz)):
        t = _time(f, xa)
        rows.append(dict(op=op, dtype=dtype, implementation=impl, time_s=t, bytes=nbytes,
                         bandwidth=nbytes / t, memory_bound=True))
      outs[impl] = (sbn(xa).astype(jnp.float32), mom(xa))
    if "pallas" in outs:   # the statistics kernel agrees with the XLA path on this device
      (y_ref, m_ref), (y_k, m_k) = outs["xla"], outs["pallas"]
      bn_checks.append(dict(
          op="SyncBN moments + forward", dtype=dtype, shape=list(shape),
          stats_max_abs_difference=max(float(jnp.max(jnp.abs(a - b)))
                                         for a, b in zip(m_ref, m_k)),
          output_max_abs_difference=float(jnp.max(jnp.abs(y_ref - y_k)))))
  nominal = next((v for k, v in NOMINAL_BANDWIDTH.items() if k in dev.device_kind), None)
  for r in rows:
    r["fraction_of_copy"] = r["bandwidth"] / copy_bw
    r["fraction_of_nominal"] = None if nominal is None else r["bandwidth"] / nominal
    # The goal is the kernels' (Pallas), memory-bound ones, against the nominal peak.
    r["meets_80pct_goal"] = (None if nominal is None or r["implementation"] != "pallas"
                             or not r.get("memory_bound") else
                             r["fraction_of_nominal"] >= BANDWIDTH_GOAL)
  return {"env": env, "rows": rows, "copy_bandwidth": copy_bw, "nominal_bandwidth": nominal,
          "kernel_checks": checks, "bn_checks": bn_checks}


WORKERS = {"compile": worker_compile, "measure": worker_measure, "confirm": worker_confirm,
           "kernels": worker_kernels, "plan": worker_plan}


def _worker_main(kind: str, spec_path: str, out_path: str) -> None:
  with open(spec_path) as f:
    spec = json.load(f)
  try:
    result = {"ok": True, "result": WORKERS[kind](spec)}
  except Exception as e:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    result = {"ok": False, "error": f"{type(e).__name__}: {e}",
              "traceback": traceback.format_exc()[-3000:]}
  with open(out_path, "w") as f:
    json.dump(result, f)


# ------------------------------------------------------------------------ orchestrator

class Runner:
  """Starts worker processes and keeps the time budget."""

  def __init__(self, args, cache_dir, tmp):
    self.args, self.cache_dir, self.tmp = args, cache_dir, tmp
    self.start = time.perf_counter()
    self.log_lines: list[str] = []
    self._count = 0
    self._lock = threading.Lock()
    self._running: dict[int, tuple[str, subprocess.Popen]] = {}
    self._stopped: set[int] = set()
    self._closed: set[str] = set()

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.args.time_budget - self.elapsed()

  def log(self, msg: str) -> None:
    line = f"[{self.elapsed():6.1f}s] {msg}"
    self.log_lines.append(line)
    print(line, flush=True)

  def stop(self, kind: str) -> int:
    """Kills the running workers of ``kind`` (each by the process this runner started);
    their `run` returns ``{"ok": False, "stopped": True}``. Returns how many."""
    with self._lock:
      self._closed.add(kind)   # none of this kind starts from now on
      procs = [(n, p) for n, (k, p) in self._running.items() if k == kind]
      self._stopped.update(n for n, _ in procs)
    for _, p in procs:
      p.kill()
    return len(procs)

  def run(self, kind: str, spec: dict, *, preallocate: bool, timeout: float | None = None):
    with self._lock:
      self._count += 1
      n = self._count
    spec_path = os.path.join(self.tmp, f"spec{n}.json")
    out_path = os.path.join(self.tmp, f"out{n}.json")
    with open(spec_path, "w") as f:
      json.dump(spec, f)
    timeout = max(10.0, min(timeout or self.left(), self.left()))
    t0 = time.perf_counter()
    with self._lock:
      if kind in self._closed:
        return {"ok": False, "stopped": True, "error": NOT_MEASURED}
      proc = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), "--worker", kind, spec_path, out_path],
          env=_worker_env(self.args.allow_cpu, self.cache_dir, preallocate),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      self._running[n] = (kind, proc)
    try:
      _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.communicate()
      return {"ok": False, "error": f"worker {kind} timed out after {timeout:.0f} s"}
    finally:
      with self._lock:
        self._running.pop(n, None)
    seconds = time.perf_counter() - t0
    if n in self._stopped:
      return {"ok": False, "stopped": True, "error": NOT_MEASURED}
    if not os.path.exists(out_path):
      return {"ok": False, "error": f"worker {kind} exited {proc.returncode} without a result",
              "stderr": stderr[-3000:]}
    with open(out_path) as f:
      res = json.load(f)
    res["seconds"] = seconds
    return res


def _fit(mem: dict, b1: int, b2: int, limit: int) -> dict:
  p1, p2 = mem[str(b1)]["total_bytes"], mem[str(b2)]["total_bytes"]
  slope = (p2 - p1) / (b2 - b1)
  fixed = p1 - slope * b1
  pred = int((limit - fixed) // slope) if slope > 0 else None
  return dict(bytes_per_example=slope, fixed_bytes=fixed, predicted_max_batch=pred)


def orchestrate(args) -> int:
  groups = QUICK_GROUPS if args.quick else GROUPS
  if args.groups:
    groups = {k: v for k, v in groups.items() if k in args.groups.split(",")}
  tmp = tempfile.mkdtemp(prefix="jmem_gpu_")
  cache_dir = os.path.join(tmp, "xla_cache")
  r = Runner(args, cache_dir, tmp)
  kspec = dict(allow_cpu=args.allow_cpu, values=2**16 * (16 if args.quick else 4096),
               bits=(2,) if args.quick else (1, 2, 4, 8),
               abn_shape=(4, 8, 8, 64) if args.quick else (128, 56, 56, 256))
  r.log("environment and kernels")
  kspec["allow_cpu"] = args.allow_cpu
  if args.no_kernels:
    kspec.update(values=2**16, bits=(2,), abn_shape=(4, 8, 8, 64))
  kern = r.run("kernels", kspec, preallocate=True, timeout=240)
  if not kern.get("ok"):
    # Without the environment nothing else can be trusted to run on the right device.
    return _nothing_measured("the first worker (environment and kernels) failed", kern, tmp)
  env = kern["result"]["env"]
  if env["backend"] != "gpu" and not args.allow_cpu:
    print(f"benchmarks/gpu.py: no GPU here (JAX backend {env['backend']!r}); nothing to "
          "measure. Run it on a machine with an NVIDIA GPU (or pass --allow-cpu --quick to "
          "check the pipeline).")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0
  env["jmem_commit"] = _git_commit()
  os.makedirs(args.output_dir, exist_ok=True)
  # Off the GPU (--allow-cpu) there is no limit to read: a small one keeps the checks quick
  # (at 256 MiB, ActNN's Pallas kernels in interpret mode took 3 minutes to confirm).
  limit = env.get("bytes_limit") or CPU_LIMIT
  results = {"env": env, "kernels": kern.get("result", {}).get("rows"),
             "copy_bandwidth": kern.get("result", {}).get("copy_bandwidth"),
             "nominal_bandwidth": kern.get("result", {}).get("nominal_bandwidth"),
             "kernel_checks": kern.get("result", {}).get("kernel_checks"),
             "bn_checks": kern.get("result", {}).get("bn_checks"),
             "groups": {}, "log": r.log_lines}
  # Which techniques each group measures: the registry's (worker_plan), highest priority
  # first.
  r.log("techniques from the registry")
  plan = r.run("plan", {"groups": groups}, preallocate=False, timeout=180)
  if not plan.get("ok"):
    return _nothing_measured("reading the technique registry failed", plan, tmp)
  groups = {k: dict(g, techniques=sorted(plan["result"][k]["techniques"], key=_rank))
            for k, g in groups.items()}
  gindex = {k: i for i, k in enumerate(groups)}
  # Phases 1-2: compile every technique at B/2 and B (the slope; B is also the measured
  # batch), then at its predicted max batch and 10% above; in parallel, filling the cache,
  # in priority order, until COMPILE_SHARE of the budget. With --reuse, slopes measured by
  # an earlier run on the same device are taken from its JSON (only B and the checks are
  # compiled again, for the cache).
  reuse = {}
  if args.reuse:
    with open(args.reuse) as f:
      old = json.load(f)
    if old["env"].get("device_kind") != env.get("device_kind"):
      raise SystemExit(f"--reuse {args.reuse} was measured on {old['env'].get('device_kind')}, "
                       f"not on this {env.get('device_kind')}.")
    for gname, gr in old["groups"].items():
      for t, row in gr["rows"].items():
        if "compiled" in row and len(row["compiled"]) == 2:
          reuse[(gname, t)] = row["compiled"]
  skip = set(filter(None, args.skip.split(",")))
  for gname, g in groups.items():
    p = plan["result"][gname]
    results["groups"][gname] = {"config": dict(g), "not_applicable": p["not_applicable"],
                                "excluded": p["excluded"], "rows": {}}
    for t in g["techniques"]:
      results["groups"][gname]["rows"][t] = ({"technique": t, "skipped": True} if t in skip
                                             else {"technique": t})
    r.log(f"{gname}: {', '.join(g['techniques'])}; not applicable: "
          f"{', '.join(p['not_applicable']) or 'none'}")

  def fitted(gname, t, compiled_rows):
    g, row = groups[gname], results["groups"][gname]["rows"][t]
    row["compiled"] = compiled_rows
    row["max_batch"] = _fit(compiled_rows, g["batch"] // 2, g["batch"], limit)
    pred = row["max_batch"]["predicted_max_batch"]
    if args.no_confirm:
      row["confirm"] = {"status": "not confirmed (--no-confirm)"}
    elif not pred or pred <= 0:
      row["confirm"] = {"status": "no prediction to confirm"}
    else:
      return (gname, t, pred, max(pred + 1, int(pred * 1.1)))
    return None

  todo = sorted(((gname, t) for gname, g in groups.items() for t in g["techniques"]
                 if t not in skip), key=lambda k: (_rank(k[1]), gindex[k[0]]))
  compile_until = args.time_budget * COMPILE_SHARE
  checks = []
  # Max-batch compiles autotune with buffers of the batch's size: few at a time (eight at
  # once exhausted an H100's 80 GB).
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool, \
       concurrent.futures.ThreadPoolExecutor(args.check_jobs) as check_pool:
    jobs = {}   # future -> (group, technique, "slope" | "reuse" | "check")

    # A max-batch check's compile only fills the cache for its check (which compiles it
    # itself otherwise), so it waits until every step's own compile has started.
    waiting = []

    def submit_check(check):
      checks.append(check)
      waiting.append(check)

    def release_checks():
      if all(f.running() or f.done() for f, v in jobs.items() if v[2] != "check"):
        while waiting:
          gname, t, p, a = waiting.pop(0)
          fut = check_pool.submit(r.run, "compile", dict(group=groups[gname], technique=t,
                                                         batches=[p, a]), preallocate=False)
          jobs[fut] = (gname, t, "check")
          pending.add(fut)
    for gname, t in todo:
      g = groups[gname]
      b = g["batch"]
      if (gname, t) in reuse:
        check = fitted(gname, t, reuse[(gname, t)])
        results["groups"][gname]["rows"][t]["compiled_reused_from"] = args.reuse
        if check:
          submit_check(check)
        jobs[pool.submit(r.run, "compile", dict(group=g, technique=t, batches=[b]),
                         preallocate=False)] = (gname, t, "reuse")
      else:
        jobs[pool.submit(r.run, "compile", dict(group=g, technique=t, batches=[b // 2, b]),
                         preallocate=False)] = (gname, t, "slope")
    r.log(f"compiling {len(jobs)} steps ({args.jobs} processes), by {compile_until:.0f} s "
          "at the latest")
    pending = set(jobs)
    release_checks()
    while pending and r.elapsed() < compile_until:
      done, pending = concurrent.futures.wait(pending, timeout=compile_until - r.elapsed(),
                                              return_when=concurrent.futures.FIRST_COMPLETED)
      for fut in sorted(done, key=lambda f: _rank(jobs[f][1])):
        gname, t, what = jobs[fut]
        res, row = fut.result(), results["groups"][gname]["rows"][t]
        if what == "check":
          row["compiled_at_max"] = res.get("result", res)
        elif not res.get("ok"):
          row["error"] = res.get("error")
          r.log(f"{gname} {t}: compile failed: {res.get('error')}")
        elif what == "reuse":
          row["compiled_this_run"] = res["result"]
        else:
          check = fitted(gname, t, res["result"])
          if check:
            submit_check(check)
      release_checks()
    if pending or waiting:
      cancelled = sum(f.cancel() for f in pending) + len(waiting)
      stopped = r.stop("compile")
      late = [jobs[f] for f in pending] + [(gn, t, "check") for gn, t, _, _ in waiting]
      r.log(f"time budget for compiling ({compile_until:.0f} s) spent: {stopped} compiles "
            f"stopped, {cancelled} not started: "
            + ", ".join(f"{gn} {t}{' (max-batch check)' if w == 'check' else ''}"
                        for gn, t, w in sorted(late, key=lambda k: _rank(k[1]))))
      for gname, t, what in late:
        row = results["groups"][gname]["rows"][t]
        if what == "slope":
          row["not_measured"] = NOT_MEASURED
        elif what == "check":
          row["compiled_at_max"] = {"skipped": "time budget: the check compiles it itself"}
  r.log("compiling done")
  # Phase 3: measure each group in its own process (peaks in ascending order), until
  # MEASURE_SHARE of the budget; each group gets a share of that time by its technique count.
  measure_until = args.time_budget * MEASURE_SHARE
  ready = {}
  for gname, g in groups.items():
    rows = results["groups"][gname]["rows"]
    ready[gname] = [t for t in g["techniques"] if "compiled" in rows[t] and "error" not in rows[t]]
  remaining = sum(len(v) for v in ready.values())
  for gname, g in groups.items():
    rows, ok = results["groups"][gname]["rows"], ready[gname]
    seconds = (measure_until - r.elapsed()) * len(ok) / max(remaining, 1)
    remaining -= len(ok)
    if not ok:
      continue
    if r.left() < 60 or seconds < 10:
      r.log(f"time budget spent: {gname} not measured")
      for t in ok:
        rows[t]["not_measured"] = NOT_MEASURED
      continue
    order = sorted(ok, key=lambda t: rows[t]["compiled"][str(g["batch"])]["total_bytes"])
    r.log(f"measuring {gname} in {seconds:.0f} s at most: {', '.join(order)}")
    res = r.run("measure", dict(group=g, batch=g["batch"], order=order, seconds=seconds,
                                repeats=5 if args.quick else 20), preallocate=True)
    if res.get("ok"):
      for t, m in res["result"].items():
        rows[t]["run"] = m
        if m.get("not_measured"):
          rows[t]["not_measured"] = m["not_measured"]
      late = [t for t, m in res["result"].items() if m.get("not_measured")]
      if late:
        r.log(f"time budget spent: {gname} {', '.join(late)} not measured")
    else:
      r.log(f"{gname}: measure failed: {res.get('error')} {res.get('traceback', '')}"
            f"{res.get('stderr', '')}")
  # Phase 4: max-batch checks, one process each, in priority order (every group's exact,
  # then the headline techniques); a check is run only where the time left covers the
  # slowest check of its group so far.
  checks.sort(key=lambda c: (_rank(c[1]), gindex[c[0]]))
  slowest, late = {}, []
  for gn, t, p, a in checks:
    row = results["groups"][gn]["rows"][t]
    if r.left() < max(40.0, slowest.get(gn, 0.0)):
      row["confirm"] = {"status": NOT_CONFIRMED}
      late.append(f"{gn} {t}")
      continue
    r.log(f"max batch {gn} {t}: running {p} then {a}")
    res = r.run("confirm", dict(group=groups[gn], technique=t, batch=p, above=a),
                preallocate=True)
    slowest[gn] = max(slowest.get(gn, 0.0), res.get("seconds", 0.0))
    row["confirm"] = res.get("result", res)
  if late:
    r.log(f"time budget spent: max-batch checks not run: {', '.join(late)}")
  for gname, gr in results["groups"].items():
    _vs_exact(gr["rows"], groups[gname]["batch"])
  r.log("done")
  results["wall_s"] = r.elapsed()
  _write(results, args)
  shutil.rmtree(tmp, ignore_errors=True)
  return 0


def _vs_exact(rows: dict, batch: int) -> None:
  """Each row's figures as ratios to exact's, measured in the same run."""
  base = rows.get("exact", {})

  def ratio(row, get):
    try:
      num, den = get(row), get(base)
    except (KeyError, TypeError):
      return None
    return None if num is None or not den else num / den
  for row in rows.values():
    if "compiled" not in row:
      continue
    b = str(batch)   # the measured batch
    row["vs_exact"] = dict(
        step_time=ratio(row, lambda r: r["run"]["step_time_s"]),
        peak_bytes_in_use=ratio(row, lambda r: r["run"]["peak_bytes_in_use"]),
        temp_bytes=ratio(row, lambda r: r["compiled"][b]["temp_bytes"]),
        compiled_total_bytes=ratio(row, lambda r: r["compiled"][b]["total_bytes"]),
        max_batch=ratio(row, lambda r: r["max_batch"]["predicted_max_batch"]))


def _nothing_measured(what: str, worker: dict, tmp: str) -> int:
  """Reports a failed worker that the rest depends on, cleans up, and returns exit 1."""
  print(f"benchmarks/gpu.py: {what}, so nothing was measured: {worker.get('error')}\n"
        f"{worker.get('traceback', '')}{worker.get('stderr', '')}", file=sys.stderr)
  shutil.rmtree(tmp, ignore_errors=True)
  return 1


def _git_commit() -> str | None:
  try:
    out = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, timeout=10)
    dirty = subprocess.run(["git", "-C", os.path.dirname(HERE), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "") or None
  except Exception:  # pylint: disable=broad-except
    return None


def _slug(kind: str) -> str:
  return "".join(ch if ch.isalnum() else "_" for ch in kind.lower()).strip("_") or "unknown"


def _gib(b):
  return "-" if b is None else f"{b / 2**30:.2f}"


def _x(ratio) -> str:
  return "-" if ratio is None else f"{ratio:.2f}"


def _confirmed(conf: dict | None) -> str:
  """The max-batch check of a row, in words."""
  if not conf:
    return "-"
  if "status" in conf:
    return conf["status"]
  at, above = conf.get("at_prediction"), conf.get("above")
  if at is None or above is None:
    return f"error: {str(conf.get('error', conf))[:100]}"

  def outcome(r):
    if r.get("fits"):
      return f"runs at {r['batch']}"
    if r.get("oom"):
      return f"OOM at {r['batch']}"
    return f"error at {r['batch']}: {r.get('error', '')[:80]}"
  if at.get("fits") and above.get("oom"):
    return f"yes: {outcome(at)}, {outcome(above)}"
  if at.get("fits") and above.get("fits"):
    return f"no (prediction low): {outcome(at)} and at {above['batch']}"
  if at.get("oom"):
    return f"no (prediction high): {outcome(at)}"
  return f"no: {outcome(at)}, {outcome(above)}"


def _write(results: dict, args) -> None:
  env = results["env"]
  stem = (f"gpu_{_slug(env.get('device_kind', 'unknown'))}" + ("_quick" if args.quick else "")
          + (f"_{args.groups.replace(',', '_')}" if args.groups else ""))
  with open(os.path.join(args.output_dir, stem + ".json"), "w") as f:
    json.dump(results, f, indent=2, default=str)
  lines = [f"# jmem on {env.get('device_kind')}", "",
           "Written by `python benchmarks/gpu.py`"
           + (" --quick --allow-cpu (pipeline check, not GPU figures)" if args.quick else "")
           + f" in {results['wall_s']:.0f} s.", ""]
  lines += [f"- {k}: {v}" for k, v in env.items()]
  if env.get("backend") != "gpu":
    lines += ["", f"Off the GPU there is no memory limit (the predictions use "
              f"{_gib(CPU_LIMIT)} GiB) and nothing runs out of memory, so every max-batch check "
              "reads 'prediction low': that checks the pipeline, not the prediction."]
  if results.get("kernel_checks"):
    lines += ["", "## Pallas kernels against the XLA path on this device", "",
              "| dtype | bits | identical codes | identical minimum | identical scale | "
              "max dequantize difference | mean error / step |",
              "|---|---:|---:|---|---:|---:|---:|"]
    for c in results["kernel_checks"]:
      lines.append(f"| {c['dtype']} | {c['bits']} | {c['codes_identical_fraction']:.6f} | "
                   f"{c['minimum_identical']} | {c['scale_identical_fraction']:.6f} | "
                   f"{c['dequantize_max_abs_difference']:.3g} | "
                   f"{c['mean_abs_error_over_step']:.3f} |")
  if results.get("bn_checks"):
    lines += ["", "## SyncBN statistics kernel against the XLA path on this device", "",
              "| dtype | shape | max difference of mean, variance, count | max output "
              "difference |", "|---|---|---:|---:|"]
    for c in results["bn_checks"]:
      lines.append(f"| {c['dtype']} | {tuple(c['shape'])} | "
                   f"{c['stats_max_abs_difference']:.3g} | "
                   f"{c['output_max_abs_difference']:.3g} |")
  goal = f"{BANDWIDTH_GOAL:.0%}"
  lines += ["", "## Kernels", "",
            f"Copy bandwidth (x*2, read+write): {results['copy_bandwidth'] or 0:.3e} B/s; "
            f"nominal HBM: {results['nominal_bandwidth']}. Goal: each memory-bound Pallas "
            f"kernel at {goal} of the nominal HBM bandwidth or more"
            + ("" if results["nominal_bandwidth"] else
               " (no nominal bandwidth known for this device, so not judged)") + ".", "",
            "| op | dtype | implementation | time (ms) | GB moved | bandwidth (GB/s) | "
            f"/ copy | / nominal | meets {goal} goal |",
            "|---|---|---|---:|---:|---:|---:|---:|---|"]
  for k in results["kernels"] or []:
    nom = "-" if k["fraction_of_nominal"] is None else f"{k['fraction_of_nominal']:.2f}"
    met = k.get("meets_80pct_goal")
    lines.append(f"| {k['op']} | {k['dtype']} | {k['implementation']} | "
                 f"{1e3 * k['time_s']:.3f} | {k['bytes'] / 1e9:.3f} | "
                 f"{k['bandwidth'] / 1e9:.0f} | {k['fraction_of_copy']:.2f} | {nom} | "
                 f"{'-' if met is None else ('yes' if met else '**no**')} |")
  if results["groups"]:
    lines += ["", "GFLOP in the step tables: XLA's cost analysis of the lowered step; in "
              "parentheses the compiled step's, which on a GPU counts library calls (cuDNN "
              "convolutions, likely cuBLAS matrix products) as nothing "
              "(`jmem.measure.step_flops`)."]
  for gname, gr in results["groups"].items():
    g = gr["config"]
    lines += ["", f"## {gname}: {g['model']}, batch {g['batch']}, {g['image']}²"
              + (f", {g['frames']} frames" if g["frames"] else "") + f", {g['dtype']}"
              + (f", {g['overrides']}" if g["overrides"] else ""), "",
              "| technique | step (ms) | step / exact | loss finite | peak in use (GiB) | "
              "peak / exact | own peak | compiled total (GiB) | temp (GiB) | temp / exact | "
              "GFLOP lowered (compiled) | MiB / example | predicted max batch | "
              "max batch / exact | max batch confirmed |",
              "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t, row in gr["rows"].items():
      if row.get("skipped"):
        lines.append(f"| {t} | skipped (--skip) |")
        continue
      if "compiled" not in row and row.get("not_measured"):
        lines.append(f"| {t} | {row['not_measured']} (not compiled) |")
        continue
      if "compiled" not in row or "error" in row:
        lines.append(f"| {t} | error: {row.get('error', '')[:120]} |")
        continue
      c = row["compiled"][str(g["batch"])]
      run = row.get("run", {})
      mb = row.get("max_batch", {})
      vs = row.get("vs_exact", {})
      step = "-" if "step_time_s" not in run else f"{1e3 * run['step_time_s']:.1f}"
      if row.get("not_measured"):
        step = row["not_measured"]
      if "error" in run:
        step = f"error: {run['error'][:100]}"
      flops = "-" if c.get("flops") is None else f"({c['flops'] / 1e9:.3g})"
      if c.get("flops_lowered") is not None:
        flops = f"{c['flops_lowered'] / 1e9:.3g} {flops}"
      lines.append(
          f"| {t} | {step} | {_x(vs.get('step_time'))} | {run.get('loss_finite', '-')} | "
          f"{_gib(run.get('peak_bytes_in_use'))} | {_x(vs.get('peak_bytes_in_use'))} | "
          f"{run.get('peak_is_own', '-')} | {_gib(c['total_bytes'])} | "
          f"{_gib(c['temp_bytes'])} | {_x(vs.get('temp_bytes'))} | {flops} | "
          f"{mb.get('bytes_per_example', 0) / 2**20:.1f} | "
          f"{mb.get('predicted_max_batch', '-')} | {_x(vs.get('max_batch'))} | "
          f"{_confirmed(row.get('confirm'))} |")
    if gr.get("not_applicable"):
      lines += ["", "Registered techniques that do not apply to this model (not measured):", ""]
      lines += [f"- {t}: {why}" for t, why in gr["not_applicable"].items()]
    if gr.get("excluded"):
      lines += ["", f"Excluded from this group: {', '.join(gr['excluded'])}."]
  lines += ["", "## Log", "", "```"] + results["log"] + ["```", ""]
  with open(os.path.join(args.output_dir, stem + ".md"), "w") as f:
    f.write("\n".join(lines))
  print(f"wrote {os.path.join(args.output_dir, stem)}.{{json,md}}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--output-dir", default=RESULTS)
  p.add_argument("--time-budget", type=float, default=570.0,
                 help="seconds; later phases are skipped (and said so) when it runs out")
  p.add_argument("--jobs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                 help="parallel compile processes")
  p.add_argument("--check-jobs", type=int, default=max(1, min(2, (os.cpu_count() or 2) // 4)),
                 help="parallel max-batch compile processes (each autotunes at a large batch)")
  p.add_argument("--groups", default="", help="comma-separated subset of the model groups")
  p.add_argument("--quick", action="store_true", help="tiny shapes (pipeline check)")
  p.add_argument("--no-confirm", action="store_true",
                 help="predict the max batch from the compiled slope but do not run it")
  p.add_argument("--skip", default="", help="comma-separated techniques not to run")
  p.add_argument("--reuse", default="",
                 help="JSON of an earlier run on the same device kind: its slopes are reused")
  p.add_argument("--no-kernels", action="store_true",
                 help="kernel timings on tiny shapes only (the environment is still read)")
  p.add_argument("--allow-cpu", action="store_true",
                 help="run on CPU too (with --quick: check the pipeline without a GPU)")
  p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    _worker_main(*args.worker)
    return 0
  return orchestrate(args)


if __name__ == "__main__":
  sys.exit(main())
