"""The planner's 1-bit rung: what compressing to 1 bit buys at the compiled peak, and what it
costs in accuracy. The planner's ladder is save -> compress at 8, 4, 2, 1 bits ->
recompute from a 2-bit input; this measures each uniform rung past 2 bits (XLA:CPU device
bytes of the AdamW train step at two batch sizes, hence the bytes one more example costs,
and XLA's FLOPs) on ResNet-20 (digits, 32x32) and ResNet-50 (224x224), and trains
ResNet-20 on the digits, exact against uniform 2-bit, uniform 1-bit and the plan at a
budget between those two (sensitivities from 16 training examples, the default 8 compiles),
seeds 0, 1, 2.
Writes results/plan_one_bit.{json,md}.

  python benchmarks/plan_one_bit.py            # about 20 minutes on 2 CPU cores
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmem  # noqa: E402
from jmem import data, measure, models, planner, train  # noqa: E402
from _common import write_report  # noqa: E402

UNIFORM = (("exact", ()), ("compress 2-bit", (jmem.Policy("compress", bits=2),)),
           ("compress 1-bit", (jmem.Policy("compress", bits=1),)),
           ("recompute_compressed 2-bit", (jmem.Policy("recompute_compressed", bits=2),)))
COMPILED = (("resnet20", 32, 1, 128), ("resnet50", 224, 3, 32))
STEPS, BATCH, SEEDS, BUDGET, MAX_COMPILES = 150, 128, (0, 1, 2), "20.5%", 8


def compiled_rows():
  rows = []
  optimizer = train.default_optimizer(1e-3, 100)
  for name, size, channels, batch in COMPILED:
    model = models.create_model(name, 10)
    for label, techniques in UNIFORM:
      m = jmem.convert(model, *techniques) if techniques else model
      at = {}
      for b in (batch, 2 * batch):
        step = planner.compile_step(m, optimizer,
                                    jax.ShapeDtypeStruct((b, size, size, channels), jnp.float32),
                                    jax.ShapeDtypeStruct((b,), jnp.int32))
        at[b] = measure.device_bytes_and_flops(step)
      rows.append(dict(model=name, image=size, batch=batch, policy=label,
                       device_bytes=at[batch][0], device_bytes_2x=at[2 * batch][0],
                       per_example=(at[2 * batch][0] - at[batch][0]) / batch,
                       flops=at[batch][1]))
      print(rows[-1], flush=True)
  return rows


def main():
  t0 = time.time()
  rows = compiled_rows()
  dataset = data.digits(32)
  model = models.create_model("resnet20", 10)
  x = jax.ShapeDtypeStruct((BATCH, 32, 32, 1), jnp.float32)
  y = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  plan = planner.plan(model, (x, y), BUDGET, max_batch=False, max_compiles=MAX_COMPILES,
                      calibration_batch=(dataset.x_train[:16], dataset.y_train[:16]))
  print(plan.table(), flush=True)
  runs = dict(UNIFORM[:3])
  runs[f"plan at {BUDGET}"] = plan.techniques
  trained = []
  for seed in SEEDS:
    for label, techniques in runs.items():
      m = jmem.convert(model, *techniques) if techniques else model
      result = train.train(m, dataset, train.TrainConfig(steps=STEPS, batch_size=BATCH,
                                                         seed=seed, progress=False))
      trained.append(dict(run=label, seed=seed, accuracy=result.test_accuracy))
      print(trained[-1], flush=True)

  exact = {(r["model"]): r for r in rows if r["policy"] == "exact"}
  md = ["# The planner's 1-bit rung", "",
        f"Written by `benchmarks/plan_one_bit.py` ({jax.default_backend()}, JAX "
        f"{jax.__version__}, 2 CPU cores, {time.time() - t0:.0f} s). Device bytes: the "
        "compiled AdamW train step's (parameters, optimiser state, batch, activations, "
        "temp); per example: the difference between the batch and twice it, over the batch; "
        "FLOPs: XLA's cost analysis. Every site is a block of the model (jmem.convert's "
        "default sites).", "",
        "| model | batch | policy, every site | device MiB | MiB / example | per example / "
        "exact | FLOPs / exact |", "|---|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    e = exact[r["model"]]
    md.append(f"| {r['model']} {r['image']}² | {r['batch']} | {r['policy']} | "
              f"{r['device_bytes'] / 2**20:.1f} | {r['per_example'] / 2**20:.2f} | "
              f"{r['per_example'] / e['per_example']:.3f} | {r['flops'] / e['flops']:.3f} |")
  md += ["", f"ResNet-20 on the digits at 32², batch {BATCH}, {STEPS} steps (jmem.train's "
         "defaults otherwise), test accuracy of 359 images (one image = 0.28 points). The "
         f"plan is `jmem.plan` at {BUDGET} of exact's bytes with sensitivities measured on "
         f"16 training examples and max_compiles={MAX_COMPILES}: {plan.device_bytes / 2**20:.1f} MiB "
         f"({'fits' if plan.fits else 'does not fit'}), FLOPs "
         f"{plan.flops / plan.exact_flops:.3f}x exact's, {plan.compiles} steps compiled; "
         "its policies: " + ", ".join(f"{c.path} {c.label}" for c in plan.choices) + ".", "",
         "| run | " + " | ".join(f"seed {s}" for s in SEEDS) + " | mean |",
         "|---|" + "---:|" * (len(SEEDS) + 1)]
  for label in runs:
    accs = [t["accuracy"] for t in trained if t["run"] == label]
    md.append(f"| {label} | " + " | ".join(f"{100 * a:.2f}%" for a in accs) +
              f" | {100 * sum(accs) / len(accs):.2f}% |")
  write_report("plan_one_bit", dict(compiled=rows, trained=trained,
                                    plan=dict(budget=BUDGET, table=plan.table(),
                                              notes=list(plan.notes),
                                              device_bytes=plan.device_bytes,
                                              fits=plan.fits, compiles=plan.compiles,
                                              flops_ratio=plan.flops / plan.exact_flops)), md)


if __name__ == "__main__":
  main()
