"""ActNN levels: ResNet-50 memory (compile-only) and digits accuracy / step time.

Writes benchmarks/results/actnn_resnet50.*, actnn_digits.* and actnn_digits_timing.*:

  python benchmarks/actnn.py [--seeds 0,1,2] [--steps 300] [--parts resnet50,digits,timing]

(1) ResNet-50, 224x224, batch 32, compile-only: saved activation bytes and compiled temp
bytes of the whole train step at L1..L5 against exact (ActNN's figure: 12x smaller
activations at L3). (2) The default bench model (ResNet-20 on 16x16 digits, 300 steps):
exact vs L2 and L3, mean of the seeds. (3) One seed of L1, L4 and L5 for their step time.
The per-site bit allocation of L3 (its gradient noise against 2 bits everywhere) is in
docs/decisions.md; `jmem.surgery.sensitivities` measures it for any model.
"""

from _common import parser, write_bench
from jmem import bench

LEVELS = tuple(f"actnn-L{i}" for i in range(1, 6))


def resnet50():
  r50 = bench.run_bench(bench.BenchConfig(model="resnet50", image_size=224, batch_size=32,
                                          techniques=LEVELS, memory_only=True), progress=False)
  for r in r50:
    r["saved_reduction_x"] = r["baseline_saved_bytes"] / r["saved_bytes"]
  write_bench(r50, "actnn_resnet50")
  print(bench.format_table(r50))


def digits(seeds, steps):
  acc = bench.run_bench(bench.BenchConfig(techniques=("actnn-L2", "actnn-L3"), seeds=seeds,
                                          steps=steps), progress=False)
  for r in acc:
    r["accuracy_minus_exact"] = r["accuracy"] - acc[0]["accuracy"]
  write_bench(acc, "actnn_digits", meta=dict(seeds=list(seeds)))
  print(bench.format_table(acc))


def timing(seeds, steps):
  rows = bench.run_bench(bench.BenchConfig(techniques=("actnn-L1", "actnn-L4", "actnn-L5"),
                                           seeds=seeds[:1], steps=steps), progress=False)
  write_bench(rows, "actnn_digits_timing")
  print(bench.format_table(rows))


def main():
  p = parser(__doc__)
  p.add_argument("--parts", default="resnet50,digits,timing")
  args = p.parse_args()
  for part in args.parts.split(","):
    if part == "resnet50":
      resnet50()
    else:
      {"digits": digits, "timing": timing}[part](args.seeds, args.steps)


if __name__ == "__main__":
  main()
