"""One technique's train step against exact's, in one process, with `benchmarks/gpu.py`'s
workers: for a short GPU lease where the full run cannot reach a step (run 4 on an H100 did
not compile ActNN L3's in its 178 s compile window).

  python benchmarks/gpu_one_step.py GROUP BATCH OUT.json [TECHNIQUE]   # from the repo root

GROUP is one of gpu.py's GROUPS or QUICK_GROUPS (``resnet8-f32 8`` checks it on a CPU, with
JAX_PLATFORMS=cpu). The technique is compiled in this process while exact compiles in a second
one; both fill the persistent cache named by JMEM_GPU_BENCH_CACHE (set it), from which
``gpu.worker_measure`` loads them: peak_bytes_in_use of each (the technique first, as its
compiled peak is the smaller), then step times interleaved with exact (20 repeats). Writes both
compiles' memory figures, the measurements and the JAX version and device to OUT.json (run 5's
JSON predates exact's compile being kept there: its log has it).
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # pylint: disable=g-import-not-at-top,wrong-import-position

name, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
technique = sys.argv[4] if len(sys.argv) > 4 else "actnn-L3:pallas"
groups = dict(gpu.GROUPS, **gpu.QUICK_GROUPS)
t0 = time.time()


def log(m):
  print(f"[{time.time() - t0:6.1f}s] {m}", flush=True)


code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import gpu; "
        f"g = dict(gpu.GROUPS, **gpu.QUICK_GROUPS)[{name!r}]; "
        "print('exact', json.dumps(gpu.worker_compile(dict(group=g, technique='exact', "
        f"batches=[{batch}]))), flush=True)")
p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
log(f"compiling {technique} (exact in a second process)")
res = {"technique": technique, "compile": gpu.worker_compile(
    dict(group=groups[name], technique=technique, batches=[batch]))}
log(f"compiled: {json.dumps(res)}")
printed = p.communicate()[0]
exact = [ln for ln in printed.splitlines() if ln.startswith("exact ")]
res["compile_exact"] = json.loads(exact[-1][len("exact "):]) if exact else None
log(f"exact compiled: {json.dumps(res['compile_exact'])}; measuring")
res["measure"] = gpu.worker_measure(dict(group=groups[name], batch=batch, seconds=1e4,
                                         repeats=20, order=[technique, "exact"]))
log(json.dumps(res["measure"]))
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
res["env"] = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
with open(out, "w") as f:
  json.dump(res, f, indent=1)
log("done")
