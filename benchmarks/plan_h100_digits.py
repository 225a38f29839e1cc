"""Does a plan made for the H100 target learn as exact training does? (issue 49's accuracy
line, for the planner's step-time objective.)

`jmem.plan(..., target="h100")` on the bench's digits model (ResNet-20 on 16x16 digits,
batch 128), at ``--budget`` of exact's device bytes, steered by the estimated step time;
then the plan's techniques and the exact model are trained on this machine with the same
seeds (300 steps, as `jmem bench`'s accuracy runs) and their test accuracies compared. The
plan is for the GPU; the training that checks it runs on the CPU.

  python benchmarks/plan_h100_digits.py [--budget 50%] [--seeds 0,1,2] [--steps 300]

Writes ``results/plan_h100_digits.{json,md}``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402  pylint: disable=wrong-import-position


def main(argv=None) -> int:
  p = _common.parser(__doc__)
  p.add_argument("--budget", default="50%")
  p.add_argument("--batch", type=int, default=128)
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jmem  # pylint: disable=g-import-not-at-top
  from jmem import bench, train  # pylint: disable=g-import-not-at-top
  dataset = bench.make_dataset("resnet20", 16)
  model = bench.create_model("resnet20", dataset.num_classes)
  x = jax.ShapeDtypeStruct((args.batch,) + tuple(dataset.example_shape), jnp.float32)
  y = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
  plan = jmem.plan(model, (x, y), args.budget, target="h100", max_batch=False)
  print(plan.table())
  rows = {}
  for name, m in (("exact", model), ("plan", jmem.convert(model, *plan.techniques))):
    accs = [train.train(m, dataset, train.TrainConfig(
        steps=args.steps, batch_size=args.batch, learning_rate=3e-3, seed=s,
        progress=False)).test_accuracy for s in args.seeds]
    rows[name] = dict(accuracy=[float(a) for a in accs], mean=float(np.mean(accs)))
    print(name, rows[name], flush=True)
  gap = rows["plan"]["mean"] - rows["exact"]["mean"]
  out = dict(budget=args.budget, batch=args.batch, seeds=list(args.seeds), steps=args.steps,
             plan=dict(fits=plan.fits, device_bytes=plan.device_bytes,
                       budget_bytes=plan.budget_bytes, seconds=plan.seconds,
                       exact_seconds=plan.exact_seconds,
                       policies={c.path: c.label for c in plan.choices}),
             accuracy=rows, plan_minus_exact=gap)
  counts = {}
  for c in plan.choices:
    counts[c.label] = counts.get(c.label, 0) + 1
  lines = [f"# A plan for the H100 target, trained: ResNet-20 on 16x16 digits", "",
           f"`jmem.plan(resnet20, batch {args.batch}, \"{args.budget}\", target=\"h100\")` "
           f"(fits: {plan.fits}; {plan.device_bytes / 2**20:.1f} of "
           f"{plan.budget_bytes / 2**20:.1f} MiB on the target; estimated step time "
           f"{plan.seconds / plan.exact_seconds:.3f}x exact's, an estimate): sites {counts}. "
           f"Trained on this machine's CPU, {args.steps} steps, seeds {list(args.seeds)}. "
           f"Written by `python benchmarks/plan_h100_digits.py --budget {args.budget}`.", "",
           "| step | test accuracy per seed | mean |", "|---|---|---:|"]
  for name, r in rows.items():
    lines.append(f"| {name} | {', '.join(f'{100 * a:.2f}%' for a in r['accuracy'])} | "
                 f"{100 * r['mean']:.2f}% |")
  lines += ["", f"Plan minus exact: {100 * gap:+.2f} points (the bar: within 0.5)."]
  _common.write_report("plan_h100_digits", out, lines, target="h100")
  return 0


if __name__ == "__main__":
  sys.exit(main())
