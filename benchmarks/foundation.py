"""Foundation benchmark: exact vs remat, trained on digits and compile-only on ResNet-50.

Writes benchmarks/results/foundation_digits.{json,md,_memory.png} and
benchmarks/results/foundation_resnet50.{json,md,_memory.png}.

  python benchmarks/foundation.py [--seeds 0,1,2] [--steps 300]
"""

import argparse
import os
import sys

from jmem import bench

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=300)
  args = p.parse_args(argv)
  seeds = tuple(int(s) for s in args.seeds.split(","))

  digits = bench.BenchConfig(techniques=("exact", "remat"), seeds=seeds, steps=args.steps)
  rows = bench.run_bench(digits, progress=False)
  bench.write_results(rows, RESULTS, stem="foundation_digits",
                      meta={"config": vars(digits) | {"seeds": list(seeds)}})
  print(bench.format_table(rows))

  r50 = bench.BenchConfig(model="resnet50", image_size=224, batch_size=32, memory_only=True)
  rows = bench.run_bench(r50, progress=False)
  bench.write_results(rows, RESULTS, stem="foundation_resnet50",
                      meta={"config": vars(r50), "note": "compile-only"})
  print(bench.format_table(rows))


if __name__ == "__main__":
  sys.exit(main())
