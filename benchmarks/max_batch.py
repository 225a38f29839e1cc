"""The largest batch that fits, per technique, on ResNet-50 at 224x224 (compile-only).

Writes benchmarks/results/max_batch_resnet50.{json,md} and _memory.png:

  python benchmarks/max_batch.py [--techniques exact,remat,...] [--batch-size 16]
                                 [--dtype bfloat16]   (writes max_batch_resnet50_bfloat16.*)

`jmem bench --memory-only` on jmem's ResNet-50: for each technique the donating train step
(SGD-with-AdamW state, as `jmem train` runs it) is compiled at the batch size and twice
it; the slope is the memory one more example costs, the intercept the fixed bytes
(weights, optimiser state, gradients), and the largest batch under 16 and 80 GiB is
confirmed by compiling it (`jmem.measure.fit_batch`). FLOPs are XLA's cost analysis of the
step: the compute cost a CPU can measure honestly. Device bytes on CPU are XLA:CPU's
buffer assignment; a GPU's come from benchmarks/gpu.py.
"""

import argparse

from _common import RESULTS
from jmem import bench

TECHNIQUES = ("exact", "remat", "actnn-L2", "actnn-L3", "actnn-L5", "inplace-abn")


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--techniques", default=",".join(TECHNIQUES))
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--dtype", default="float32", choices=bench.DTYPES)
  args = p.parse_args()
  config = bench.BenchConfig(model="resnet50", image_size=args.image_size,
                             batch_size=args.batch_size,
                             techniques=tuple(args.techniques.split(",")), memory_only=True,
                             dtype=args.dtype)
  rows = bench.run_bench(config, progress=False)
  stem = "max_batch_resnet50" + ("" if args.dtype == "float32" else f"_{args.dtype}")
  bench.write_results(rows, RESULTS, stem=stem,
                      meta={"config": {k: v for k, v in vars(config).items()},
                            "note": "compile-only; XLA:CPU buffer assignment" + (
                          "" if args.dtype == "float32" else
                          "; XLA:CPU may compute bf16 convolutions in float32, so bfloat16 "
                          "figures that count come from a GPU (benchmarks/gpu.py)")})
  print(bench.format_table(rows))


if __name__ == "__main__":
  main()
