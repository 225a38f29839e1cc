"""ActNN levels: ResNet-50 memory (compile-only) and digits accuracy / step time.

Writes benchmarks/results/actnn_resnet50.*, actnn_digits.*, actnn_digits_timing.* and
actnn_allocation.*:

  python benchmarks/actnn.py [--seeds 0,1,2] [--steps 300]
      [--parts resnet50,digits,timing,allocation]

(1) ResNet-50, 224x224, batch 32, compile-only: saved activation bytes and compiled temp
bytes of the whole train step at L1..L5 against exact (ActNN's figure: 12x smaller
activations at L3). (2) The default bench model (ResNet-20 on 16x16 digits, 300 steps):
exact vs L2 and L3, mean of the seeds. (3) One seed of L1, L4 and L5 for their step time.
(4) The per-layer bit allocation of L3 on that model (the calibration batch of the bench
technique): each site's GACT sensitivity, weight and bits, and the measured gradient noise
|g_q - g|^2 (16 dithers) of the allocation against 2 bits everywhere.
"""


from _common import parser, write_bench, write_report
from jmem import bench, data, models
from jmem.ops import actnn
from jmem.ops.actnn import technique as actnn_technique

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
  p.add_argument("--parts", default="resnet50,digits,timing,allocation")
  args = p.parse_args()
  for part in args.parts.split(","):
    if part == "resnet50":
      resnet50()
    elif part == "allocation":
      allocation()
    else:
      {"digits": digits, "timing": timing}[part](args.seeds, args.steps)


def allocation(model_name="resnet20", image_size=16, batch=actnn_technique.CALIBRATION_BATCH):
  ds = data.digits(image_size)
  model = models.create_model(model_name, ds.num_classes)
  params, loss_fn, xy = bench.calibration_problem(model, ds, batch)
  sens, weights = actnn.sensitivities(model, loss_fn, params, xy)
  bits = actnn.allocate_bits(sens, weights)
  level = actnn.Level("L3-calibrated", block_bits=2, layer_bits=tuple(bits.items()))
  noise = {name: actnn.gradient_noise(model, loss_fn, params, xy, lv, num_seeds=16)
           for name, lv in (("uniform-2bit", "L3"), ("calibrated", level))}
  out = dict(model=model_name, image_size=image_size, batch=len(xy[0]),
             average_bits=level.average_bits(weights), gradient_noise=noise,
             sites=[dict(site=p, sensitivity=sens[p], values=weights[p], bits=bits[p])
                    for p in sens])
  lines = [f"# ActNN L3 per-layer bit allocation: {model_name}, {image_size}x{image_size} "
           f"digits, calibration batch {len(xy[0])}, initial weights (seed 0)", "",
           "| site | sensitivity C | values quantized | bits |", "|---|---:|---:|---:|"]
  lines += [f"| {p} | {sens[p]:.4g} | {weights[p]} | {bits[p]} |" for p in sens]
  lines += ["", f"Weighted average: {out['average_bits']:.3f} bits.", "",
            "Gradient noise, mean |g_q - g|^2 over 16 dithers (lower is better): "
            f"2 bits everywhere {noise['uniform-2bit']:.4g}, allocated "
            f"{noise['calibrated']:.4g} ({noise['calibrated'] / noise['uniform-2bit']:.2f}x)."]
  write_report("actnn_allocation", out, lines)


if __name__ == "__main__":
  main()
