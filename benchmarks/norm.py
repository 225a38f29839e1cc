"""InPlace-ABN vs its BN + leaky_relu twin, and SyncBN vs Flax BatchNorm on unbalanced masks.

Writes benchmarks/results/inplace_abn.{json,md,_memory.png} and
benchmarks/results/sync_bn.{json,md}. Runs on 8 simulated CPU devices:

  python benchmarks/norm.py [--seeds 0,1,2] [--steps 300] [--parts sync_bn,inplace_abn]

``--parts sync_bn`` alone takes seconds; ``inplace_abn`` trains preact20 per seed.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402

from _common import RESULTS, parser, write_bench, write_report  # noqa: E402
from jmem import bench, tour  # noqa: E402
from jmem.parallel import sync_bn  # noqa: E402


def inplace_abn_rows(seeds, steps):
  if "bn-leaky" not in bench.technique_names():
    bench.register_technique(bench.Technique(
        "bn-leaky", lambda implementation: None,
        "BN + leaky_relu(0.01): InPlace-ABN's exact twin (preact20 has leaky_relu 0.01)"))
  config = bench.BenchConfig(model="preact20", techniques=("bn-leaky", "inplace-abn"),
                             seeds=seeds, steps=steps)
  rows = bench.run_bench(config, progress=False)
  twin = next(r for r in rows if r["technique"] == "bn-leaky")
  for r in rows:
    r["saved_ratio_to_twin"] = r["saved_bytes"] / twin["saved_bytes"]
    r["temp_ratio_to_twin"] = r["temp_bytes"] / twin["temp_bytes"]
    r["time_ratio_to_twin"] = r["step_time_s"] / twin["step_time_s"]
    r["accuracy_minus_twin"] = r["accuracy"] - twin["accuracy"]
  return config, rows


def sync_bn_rows(counts=(5, 0, 3, 8, 1, 0, 2, 7), mean=3.0, std=2.0):
  """Flax's BatchNorm and jmem's SyncBatchNorm on the same masked, unbalanced batch
  (`jmem.tour.sync_bn_check`, which the tour's SyncBN row runs too)."""
  return [dict(implementation=name, **tour.sync_bn_check(counts, mean, std, module=module))
          for name, module in (("flax.linen.BatchNorm", nn.BatchNorm),
                               ("jmem SyncBatchNorm", sync_bn.SyncBatchNorm))]


def _format_counts(counts):
  return ", ".join(f"{n} {op}" for op, n in counts.items()) or "none"


def main(argv=None):
  p = parser(__doc__)
  p.add_argument("--parts", default="sync_bn,inplace_abn",
                 type=lambda v: tuple(v.split(",")))
  args = p.parse_args(argv)
  unknown = set(args.parts) - {"sync_bn", "inplace_abn"}
  if unknown:
    p.error(f"unknown --parts {sorted(unknown)}; choose from sync_bn, inplace_abn")
  if "sync_bn" in args.parts:
    write_sync_bn()
  if "inplace_abn" in args.parts:
    write_inplace_abn(args.seeds, args.steps)


def write_sync_bn():
  sync = (sync_bn_rows() + sync_bn_rows((5, 1, 3, 8, 1, 2, 2, 7))
          + sync_bn_rows((5, 1, 3, 8, 1, 2, 2, 7), mean=1e4, std=1e-2))
  lines = ["# SyncBN vs flax.linen.BatchNorm: masked, unbalanced batch over 8 devices", "",
           "Oracle: plain BN on the concatenated valid samples. Forward+backward is the gradient "
           "of a local loss (no loss psum), so every collective counted (in the compiled HLO) "
           "is the layer's. Errors are absolute: outputs are normalised (std 1); the running "
           "mean (momentum 0, so the batch mean) is float32, whose spacing at 1e4 is 1e-3.", "",
           "| implementation | valid per device | data mean, std | max abs error (valid) | "
           "NaN outputs | running-mean error | collectives fwd | collectives fwd+bwd |",
           "|---|---|---|---:|---:|---:|---|---|"]
  for r in sync:
    lines.append(f"| {r['implementation']} | {r['counts']} | {r['data_mean']:g}, "
                 f"{r['data_std']:g} | {r['max_abs_error_valid']:.3g} | "
                 f"{r['nan_outputs']} "
                 f"| {r['running_mean_error']:.3g} | {_format_counts(r['collectives_forward'])} | "
                 f"{_format_counts(r['collectives_forward_backward'])} |")
  write_report("sync_bn", {"meta": {"devices": "8 simulated CPU"}, "rows": sync}, lines)


def write_inplace_abn(seeds, steps):
  config, rows = inplace_abn_rows(seeds, steps)
  write_bench(rows, "inplace_abn",
              meta={"config": vars(config) | {"seeds": list(seeds)},
                    "twin": "bn-leaky (BN + leaky_relu 0.01, same preact20)"})
  extra = ["", "| technique | saved / twin | temp / twin | step time / twin | accuracy - twin |",
           "|---|---:|---:|---:|---:|"]
  for r in rows:
    extra.append(f"| {r['technique']} | {r['saved_ratio_to_twin']:.3f} | "
                 f"{r['temp_ratio_to_twin']:.3f} | {r['time_ratio_to_twin']:.2f} | "
                 f"{100 * r['accuracy_minus_twin']:+.2f} pt |")
  with open(os.path.join(RESULTS, "inplace_abn.md"), "a") as f:
    f.write("\n".join(extra) + "\n")
  print(bench.format_table(rows) + "\n".join(extra))


if __name__ == "__main__":
  main()
