"""Soak: the two-process command of docs/devices.md, run again and again, must finish every time.

Issue 50: `jmem train --model resnet8 --technique sync-bn --mesh 8 --local-devices 4` in 2
processes on 127.0.0.1 (2 x 4 simulated CPU devices) stopped for good in 6 of 9 runs of 400
steps (both processes alive at 0% CPU), and one process on 8 devices aborted (exit 134) in 2
of 2; XLA:CPU's collectives with many steps in flight. `jmem.train` now waits for each step
on XLA:CPU with several devices (`TrainConfig.wait_each_step`).

  python benchmarks/soak_multiprocess.py --runs 10 --steps 400   # about 30 min on 2 cores
  python benchmarks/soak_multiprocess.py --cost-steps 100          # the cost of waiting

Each run: both processes started with a fresh port, bounded by --timeout and killed by their
PIDs when over it; a run is complete when both exit 0 and process 0 prints the test
accuracy. The cost: one process on 8 devices, the same model and step, with and without
waiting, the wall time of 3N steps less that of N (N = --cost-steps), per step. Writes results/soak_multiprocess.{json,md}, stamped with the commit and JAX version.
"""

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

COMMAND = ["train", "--model", "resnet8", "--technique", "sync-bn", "--mesh", "8",
           "--local-devices", "4", "--no-progress"]


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _quiet(text: str) -> list[str]:
  return [l for l in text.splitlines() if "cudart_stub" not in l and "absl::" not in l]


def soak_run(steps: int, timeout: float) -> dict:
  port = _port()
  procs = []
  for pid in (0, 1):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JMEM_COORDINATOR=f"127.0.0.1:{port}",
               JMEM_NUM_PROCESSES="2", JMEM_PROCESS_ID=str(pid), TF_CPP_MIN_LOG_LEVEL="3")
    procs.append(subprocess.Popen([sys.executable, "-m", "jmem.cli", *COMMAND, "--steps",
                                   str(steps)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env))
  start = time.monotonic()
  outs, hung = [], False
  for p in procs:
    left = max(1.0, timeout - (time.monotonic() - start))
    try:
      outs.append(p.communicate(timeout=left))
    except subprocess.TimeoutExpired:
      hung = True
      for q in procs:
        q.kill()
      outs.append(p.communicate())
  seconds = time.monotonic() - start
  codes = [p.returncode for p in procs]
  accuracy = [l for l in _quiet(outs[0][0]) if l.startswith("test accuracy")]
  return {"exit_codes": codes, "seconds": round(seconds, 1), "hung": hung,
          "complete": codes == [0, 0] and bool(accuracy) and not hung,
          "accuracy": accuracy[0] if accuracy else None,
          "stderr_tail": [_quiet(e)[-3:] for _, e in outs]}


_COST = r"""
import json, sys, time
import jax
from jmem import bench, cli, train
wait, steps = sys.argv[1] == "wait", int(sys.argv[2])
ds = bench.make_dataset("resnet8", 16)                 # jmem train's defaults, on --mesh 8
model = cli._on_mesh(bench.build_model(
    "sync-bn", bench.create_model("resnet8", ds.num_classes, "float32"), ds, 128),
    (8, 1, 1), "sync-bn")
cfg = dict(batch_size=128, progress=False, wait_each_step=wait)
took = []
for n in (steps, 3 * steps):     # the difference leaves out compiling and evaluating
  t = time.perf_counter()
  train.train(model, ds, train.TrainConfig(steps=n, **cfg))
  took.append(time.perf_counter() - t)
print(json.dumps({"seconds_per_step": (took[1] - took[0]) / (2 * steps)}))
"""


def cost(steps: int, timeout: float) -> dict:
  out = {}
  for mode in ("wait", "async"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    try:
      p = subprocess.run([sys.executable, "-c", _COST, mode, str(steps)], capture_output=True,
                         text=True, env=env, timeout=timeout)
      lines = [l for l in _quiet(p.stdout) if l.startswith("{")]
      out[mode] = {"exit_code": p.returncode,
                   "ms_per_step": (round(1e3 * json.loads(lines[-1])["seconds_per_step"], 1)
                                   if lines else None),
                   "stderr_tail": _quiet(p.stderr)[-3:]}
    except subprocess.TimeoutExpired:
      out[mode] = {"exit_code": None, "ms_per_step": None, "hung": True}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=10)
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
  ap.add_argument("--cost-steps", type=int, default=0,
                  help="also time this many steps with and without waiting (0: skip)")
  args = ap.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  from jmem import bench  # pylint: disable=g-import-not-at-top
  runs = []
  for i in range(args.runs):
    runs.append(soak_run(args.steps, args.timeout))
    r = runs[-1]
    print(f"run {i + 1}/{args.runs}: {'complete' if r['complete'] else 'FAILED'} "
          f"{r['exit_codes']} in {r['seconds']} s", flush=True)
  result = {"commit": bench.source_commit(), "date": datetime.date.today().isoformat(),
            "jax": jax.__version__, "device": "CPU, 2 processes x 4 simulated devices",
            "command": "jmem " + " ".join(COMMAND) + f" --steps {args.steps}",
            "runs": runs, "complete": sum(r["complete"] for r in runs)}
  if args.cost_steps:
    result["cost"] = {"steps": args.cost_steps, **cost(args.cost_steps, args.timeout)}
  lines = ["# Soak: the two-process command of docs/devices.md", "",
           f"- commit {result['commit']}, {result['date']}, JAX {result['jax']}, "
           f"{result['device']}",
           f"- command (each process): `{result['command']}`",
           f"- **{result['complete']} of {len(runs)} runs complete** (timeout "
           f"{args.timeout:.0f} s per run)", "",
           "| run | complete | exit codes | seconds |", "|---:|---|---|---:|"]
  lines += [f"| {i + 1} | {'yes' if r['complete'] else 'no'} | {r['exit_codes']} | "
            f"{r['seconds']} |" for i, r in enumerate(runs)]
  if args.cost_steps:
    c = result["cost"]
    lines += ["", f"Cost of waiting for each step (one process, 8 devices: the wall time of "
              f"{3 * c['steps']} steps less that of {c['steps']}, per step):", "",
              "| dispatch | exit code | ms / step |", "|---|---|---:|"]
    lines += [f"| {m} | {c[m].get('exit_code')} | {c[m].get('ms_per_step')} |"
              for m in ("wait", "async")]
  _common.write_report("soak_multiprocess", result, lines)
  return 0 if result["complete"] == len(runs) else 1


if __name__ == "__main__":
  sys.exit(main())
