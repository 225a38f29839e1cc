"""Foundation benchmark: exact vs remat, trained on digits and compile-only on ResNet-50.

Writes benchmarks/results/foundation_digits.{json,md,_memory.png} and
benchmarks/results/foundation_resnet50.{json,md,_memory.png}.

  python benchmarks/foundation.py [--seeds 0,1,2] [--steps 300]
"""

import sys

from _common import RESULTS, seeds_and_steps
from jmem import bench


def main(argv=None):
  seeds, steps = seeds_and_steps(__doc__, argv)

  digits = bench.BenchConfig(techniques=("exact", "remat"), seeds=seeds, steps=steps)
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
