"""`jmem plan --target h100` on ResNet-50 224² at batch 128, float32 and bfloat16, against
every uniform technique (issue 49's planner line).

For each dtype and each budget (a share of exact's compiled device bytes at batch 128): the
plan, compiled for the H100 target (XLA:GPU's buffer assignment, no GPU needed), and every
uniform technique compiled the same way: does it fit, at what estimated step time
(`jmem.measure.estimate_step_time`, the H100 fit of ``benchmarks/step_time.py``: an
estimate, not a measured time). The plan must fit at a lower estimated step time than every
uniform technique that fits. Uniform: exact, ``remat``, ActNN's block compression at 8, 4,
2 (= ``actnn-L3``, uncalibrated) and 1 bits everywhere (``jmem.Policy("compress")``),
``actnn-L2`` and ``recompute-2bit``, each built with ``jmem.convert`` as a user builds it.
The step is the GPU table's (``benchmarks/gpu.py``): AdamW, donated, 1000 classes.

  python benchmarks/plan_h100.py [--dtypes float32,bfloat16] [--budgets 40%,20%]

Writes ``results/plan_h100.{json,md}``. About 30 compiles per dtype (2 cores: 0.5-1.5
minutes each); ``--uniform-from results/plan_h100.json`` reuses that file's uniform rows;
``--merge a.json b.json`` writes one report of runs made apart (e.g. one dtype each, in
parallel), stamped with the commit they ran at.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402  pylint: disable=wrong-import-position
import gpu  # noqa: E402  pylint: disable=wrong-import-position

BATCH = 128
UNIFORM = ("exact", "remat", "actnn-L2", "compress-8", "compress-4", "actnn-L3",
           "compress-1", "recompute-2bit")
GROUP = {"float32": "resnet50-f32", "bfloat16": "resnet50-bf16"}


def _uniform(model, name: str):
  import jmem  # pylint: disable=g-import-not-at-top
  if name.startswith("compress-"):
    return jmem.convert(model, jmem.Policy("compress", bits=int(name.split("-")[1])))
  return gpu.convert(model, name)


def _row(model, optimizer, x, y, dtype: str) -> dict:
  """Device bytes, temp bytes, lowered FLOPs and the estimated step time of ``model``'s
  donated AdamW step compiled for the H100 target."""
  from jmem import measure, planner  # pylint: disable=g-import-not-at-top
  on = measure.target("h100")
  t0 = time.perf_counter()
  step, args = planner._train_step(model, optimizer, x, y)  # pylint: disable=protected-access
  lowered = on.lower(step, *args)
  compiled = on.compile_lowered(lowered)
  total, flops = measure.device_bytes_and_flops(compiled, lowered)
  est = measure.estimate_step_time(compiled, flops, dtype=dtype)
  return dict(device_bytes=int(total),
              temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
              flops=float(flops), seconds=est.seconds, compile_seconds=time.perf_counter() - t0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--budgets", default="40%,20%")
  p.add_argument("--uniform", default=",".join(UNIFORM))
  p.add_argument("--uniform-from", default=None)
  p.add_argument("--no-plan", action="store_true", help="the uniform rows only")
  p.add_argument("--stem", default="plan_h100")
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                 help="write one report of these runs' results (each run's own --dtypes), "
                 "stamped with the commit they ran at, instead of running")
  args = p.parse_args(argv)
  if args.merge:
    return _merge(args)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import jmem  # pylint: disable=g-import-not-at-top
  old = {}
  if args.uniform_from:
    with open(args.uniform_from) as f:
      old = json.load(f).get("dtypes", {})
  out = {"batch": BATCH, "dtypes": {}}
  path = os.path.join(_common.RESULTS, f"{args.stem}.json")
  for dtype in args.dtypes.split(","):
    group = gpu.GROUPS[GROUP[dtype]]
    model = gpu.make_model(group)
    optimizer = optax.adamw(1e-3)
    x = jax.ShapeDtypeStruct((BATCH, 224, 224, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    entry = out["dtypes"][dtype] = {"uniform": dict(old.get(dtype, {}).get("uniform", {})),
                                    "plans": {}}
    for name in args.uniform.split(","):
      if name not in entry["uniform"]:
        entry["uniform"][name] = _row(_uniform(model, name), optimizer, x, y, dtype)
        print(dtype, name, entry["uniform"][name], flush=True)
        _dump(out, path)
    if args.no_plan:
      continue
    exact = entry["uniform"]["exact"]
    for share in args.budgets.split(","):
      t0 = time.perf_counter()
      result = jmem.plan(model, (x, y), share, optimizer=optimizer, target="h100")
      budget = result.budget_bytes
      uniform_fit = {n: r for n, r in entry["uniform"].items() if r["device_bytes"] <= budget}
      fastest = min(uniform_fit.items(), key=lambda kv: kv[1]["seconds"], default=None)
      entry["plans"][share] = dict(
          budget_bytes=budget, device_bytes=result.device_bytes, fits=result.fits,
          flops=result.flops, seconds=result.seconds, exact_seconds=result.exact_seconds,
          objective=result.objective, compiles=result.compiles,
          wall_seconds=time.perf_counter() - t0,
          policies=[c.label for c in result.choices],
          sites=[c.path for c in result.choices], notes=list(result.notes),
          uniform_that_fit=sorted(uniform_fit), fastest_uniform=fastest and fastest[0],
          beats_every_uniform=bool(result.fits and all(
              result.seconds < r["seconds"] for r in uniform_fit.values())),
          exact_device_bytes_plan=result.exact_device_bytes,
          exact_device_bytes_row=exact["device_bytes"])
      print(dtype, share, {k: v for k, v in entry["plans"][share].items() if k != "notes"},
            flush=True)
      _dump(out, path)
  _write(out, args)
  return 0


def _merge(args) -> int:
  out, commits, dtypes = {"batch": BATCH, "dtypes": {}}, set(), []
  for path in args.merge:
    with open(path) as f:
      run = json.load(f)
    commits.add(run["meta"]["commit"])
    out["dtypes"].update(run["dtypes"])
    dtypes += list(run["dtypes"])
  if len(commits) != 1:
    raise SystemExit(f"--merge takes runs of one commit, got {sorted(commits)}")
  args.dtypes = ",".join(dtypes)
  _write(out, args, meta={"commit": commits.pop(), "merged_from": [
      os.path.basename(p) for p in args.merge]})
  return 0


def _dump(out, path):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path + ".partial", "w") as f:
    json.dump(out, f, indent=1)


def _write(out, args, meta=None):
  gib = lambda b: f"{b / 2**30:.3f}"
  lines = ["# jmem plan --target h100: ResNet-50 224², batch 128", "",
           "Every figure is compiled for the H100 target (XLA:GPU's buffer assignment, no "
           "GPU). Step times are **estimates** (`jmem.measure.estimate_step_time`, the H100 "
           "fit of `benchmarks/step_time.py`), not measured. Written by `python "
           f"benchmarks/plan_h100.py --dtypes {args.dtypes} --budgets {args.budgets}`.", ""]
  for dtype, entry in out["dtypes"].items():
    exact = entry["uniform"]["exact"]
    lines += [f"## {dtype}", "", "| step | device GiB | temp GiB | FLOPs / exact | "
              "est. step / exact | " + " | ".join(f"fits {s}" for s in entry["plans"]) + " |",
              "|---|---:|---:|---:|---:|" + "---:|" * len(entry["plans"])]
    for name, r in entry["uniform"].items():
      fits = ["yes" if r["device_bytes"] <= p["budget_bytes"] else "no"
              for p in entry["plans"].values()]
      lines.append(f"| {name} | {gib(r['device_bytes'])} | {gib(r['temp_bytes'])} | "
                   f"{r['flops'] / exact['flops']:.3f} | {r['seconds'] / exact['seconds']:.3f} |"
                   + "".join(f" {v} |" for v in fits))
    for share, p in entry["plans"].items():
      lines.append(f"| **plan at {share}** ({gib(p['budget_bytes'])} GiB) | "
                   f"{gib(p['device_bytes'])} | - | {p['flops'] / exact['flops']:.3f} | "
                   f"{p['seconds'] / exact['seconds']:.3f} | " +
                   " | ".join(("fits" if p["fits"] else "MISSES") if s == share else ""
                              for s in entry["plans"]) + " |")
    lines.append("")
    for share, p in entry["plans"].items():
      counts = {}
      for label in p["policies"]:
        counts[label] = counts.get(label, 0) + 1
      lines += [f"Plan at {share}: {p['compiles']} compiles, {p['wall_seconds'] / 60:.1f} min; "
                f"sites {counts}; uniform techniques that fit: {p['uniform_that_fit']} (fastest "
                f"{p['fastest_uniform']}); the plan is faster than every one of them: "
                f"**{p['beats_every_uniform']}**.", ""]
  _common.write_report(args.stem, out, lines, target="h100", meta=meta)


if __name__ == "__main__":
  sys.exit(main())
