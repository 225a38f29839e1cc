"""ActNN levels: ResNet-50 memory (compile-only) and digits accuracy / step time.

Writes benchmarks/results/actnn_resnet50.*, actnn_digits.* and actnn_digits_timing.*:

  python benchmarks/actnn.py [--seeds 0,1,2] [--steps 300]

(1) ResNet-50, 224x224, batch 32, compile-only: saved activation bytes and compiled temp
bytes of the whole train step at L1..L5 against exact (ActNN's figure: 12x smaller
activations at L3). (2) The default bench model (ResNet-20 on 16x16 digits, 300 steps):
exact vs L2 and L3, mean of the seeds. (3) One seed of L1, L4 and L5 for their step time.
"""

from _common import RESULTS, seeds_and_steps
from jmem import bench

LEVELS = tuple(f"actnn-L{i}" for i in range(1, 6))


def main():
  seeds, steps = seeds_and_steps(__doc__)
  r50 = bench.run_bench(bench.BenchConfig(model="resnet50", image_size=224, batch_size=32,
                                          techniques=LEVELS, memory_only=True), progress=False)
  for r in r50:
    r["saved_reduction_x"] = r["baseline_saved_bytes"] / r["saved_bytes"]
  bench.write_results(r50, RESULTS, stem="actnn_resnet50")
  print(bench.format_table(r50))
  acc = bench.run_bench(bench.BenchConfig(techniques=("actnn-L2", "actnn-L3"), seeds=seeds,
                                          steps=steps), progress=False)
  for r in acc:
    r["accuracy_minus_exact"] = r["accuracy"] - acc[0]["accuracy"]
  bench.write_results(acc, RESULTS, stem="actnn_digits", meta=dict(seeds=list(seeds)))
  print(bench.format_table(acc))
  timing = bench.run_bench(bench.BenchConfig(techniques=("actnn-L1", "actnn-L4", "actnn-L5"),
                                             seeds=seeds[:1], steps=steps), progress=False)
  bench.write_results(timing, RESULTS, stem="actnn_digits_timing")
  print(bench.format_table(timing))


if __name__ == "__main__":
  main()
