"""Does `jmem bench --target h100` give what a real H100 held? (issue 47)

  python benchmarks/h100_target_check.py          # runs the bench (about 30 min on 2 cores)
  python benchmarks/h100_target_check.py --from benchmarks/results/h100_target_bench

Runs, as a user would, `jmem bench --target h100 --memory-only --no-calibration` on ResNet-50
224² at batch 64 (the per-example temp bytes are the slope between batches 64 and 128) for
exact, remat, actnn-L3:xla, actnn-L3:pallas and recompute-2bit, into
results/h100_target_bench/, and compares each row's MiB per example with the real H100's
of 2026-11-27 (results/gpu/h100_2026-11-27_gpu_true_figures.json: JAX 0.11.2, CUDA 13,
commit 7eb2f7d). The bench's step is not exactly that run's: digits (1 channel, 10
classes) and jmem's default optimizer against 3 channels, 1000 classes and optax.adamw;
what grows with the batch is the network's activations, the same in both. Writes
results/h100_target_check.{json,md}.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

H100 = os.path.join(_common.RESULTS, "gpu", "h100_2026-11-27_gpu_true_figures.json")
BENCH_DIR = os.path.join(_common.RESULTS, "h100_target_bench")
TECHNIQUES = ("exact", "remat", "actnn-L3:xla", "actnn-L3:pallas", "recompute-2bit:pallas")
# A bench output written before commit a373672 names the H100 run's recompute-2bit:pallas
# "recompute-2bit" (its automatic choice on a GPU was then the kernels; now it is XLA).
H100_NAME = {"recompute-2bit": "recompute-2bit:pallas"}


def run_bench(output_dir: str) -> None:
  subprocess.run(["jmem", "bench", "--target", "h100", "--memory-only", "--no-calibration",
                  "--model", "resnet50", "--image-size", "224", "--batch-size", "64",
                  "--techniques", ",".join(TECHNIQUES), "--budgets", "", "--output-dir",
                  output_dir, "--no-progress"], check=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--from", dest="source", default=None,
                  help="a finished bench's output folder (default: run the bench into "
                  f"{os.path.relpath(BENCH_DIR)})")
  ap.add_argument("--bench-commit", default=None,
                  help="the commit a --from bench ran at, where its bench.json names none "
                  "(written before bench results were stamped)")
  args = ap.parse_args(argv)
  source = args.source or BENCH_DIR
  if args.source is None:
    run_bench(source)
  with open(os.path.join(source, "bench.json")) as f:
    bench = json.load(f)
  with open(H100) as f:
    h100 = json.load(f)
  real = {r["technique"]: r["mib_per_example"] for r in h100["rows"]
          if r["model"] == "jmem ResNet-50" and r["dtype"] == "float32"}
  rows = []
  for r in bench["rows"]:
    target = r["per_example_temp_bytes"] / 2**20
    on_h100 = real.get(H100_NAME.get(r["technique"], r["technique"]))
    rows.append({"technique": r["technique"], "target_mib_per_example": round(target, 2),
                 "h100_mib_per_example": on_h100,
                 "gap_percent": (None if on_h100 is None
                                 else round(100 * (target - on_h100) / on_h100, 2))})
  within = all(r["gap_percent"] is not None and abs(r["gap_percent"]) <= 1 for r in rows)
  commit = bench["meta"].get("commit")
  if commit is None and args.bench_commit:
    commit = f"{args.bench_commit} (given: its bench.json names none)"
  result = {"bench": {"source": os.path.relpath(source, _common.RESULTS), "commit": commit,
                      "jax_version": bench["meta"].get("jax_version"),
                      "target": bench["rows"][0].get("target_label")},
            "h100": {k: h100["meta"][k] for k in ("device", "jax_version", "commit", "date")},
            "rows": rows, "all_within_1_percent": within}
  lines = ["# `jmem bench --target h100` against a real H100", "",
           f"- bench: `results/{result['bench']['source']}/bench.json`, commit "
           f"{result['bench']['commit']}, JAX {result['bench']['jax_version']}; "
           f"{result['bench']['target']}",
           f"- H100: {result['h100']['device']}, JAX {result['h100']['jax_version']}, commit "
           f"{result['h100']['commit']}, {result['h100']['date']} "
           "(`results/gpu/h100_2026-11-27_gpu_true_figures.md`)",
           "- MiB per example: the temp bytes' slope between batches 64 and 128 of ResNet-50 "
           "224² (float32); the bench's step trains digits (1 channel, 10 classes) with "
           "jmem's default optimizer, the H100's 3 channels, 1000 classes with optax.adamw",
           "", "| technique | H100 target | real H100 | gap |", "|---|---:|---:|---:|"]
  lines += [f"| {r['technique']} | {r['target_mib_per_example']:.2f} | "
            f"{r['h100_mib_per_example']} | {r['gap_percent']:+.2f}% |" for r in rows]
  lines += ["", f"Every row within 1%: {'yes' if within else 'no'}."]
  _common.write_report("h100_target_check", result, lines, target="h100")
  return 0


if __name__ == "__main__":
  sys.exit(main())
