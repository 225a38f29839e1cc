"""Does ordering the planner's bit reductions by GACT sensitivity pay? ResNet-20 on the
digits at 32x32, batch 128: for budgets that push some sites below 8 bits, `jmem.plan` with
``calibration_batch`` (16 training examples; sensitivities at the initial weights) against
the same plan without (bits lowered in order of bytes). Reported per plan: its bits per
site, compiled device bytes and FLOPs (XLA:CPU), and the gradient noise it adds, measured:
``E |g_q - g|^2 / |g|^2`` over 16 dither seeds on a 128-example training batch, at the
initial weights and after 150 exact training steps (seed 0). Writes
results/plan_sensitivity.{json,md}.

  python benchmarks/plan_sensitivity.py
"""

import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402

import jmem  # noqa: E402
from jmem import data, models, planner, train  # noqa: E402
from jmem.ops.actnn.technique import calibration_problem_on  # noqa: E402
from _common import write_report  # noqa: E402

BATCH, SEEDS, SHARES = 128, 16, ("40%", "30%", "25%")


def gradient_noise(model, techniques, params, state, x, y):
  """Mean relative squared error of the planned model's gradient against exact."""
  def grad_fn(m):
    loss = train.make_loss(train.model_fns(m))
    return jax.jit(lambda p, k: ravel_pytree(jax.grad(
        lambda q: loss(q, state, x, y, k)[0])(p))[0])
  exact = grad_fn(model)(params, jax.random.key(0))
  planned = grad_fn(jmem.convert(model, *techniques))
  errs = [float(jnp.sum((planned(params, jax.random.key(100 + s)) - exact) ** 2))
          for s in range(SEEDS)]
  return float(np.mean(errs) / jnp.sum(exact**2))


def main():
  dataset = data.digits(32)
  model = models.create_model("resnet20", 10)
  x_spec = jax.ShapeDtypeStruct((BATCH,) + dataset.example_shape, jnp.float32)
  y_spec = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  calibration = (dataset.x_train[:16], dataset.y_train[:16])
  x, y = jnp.asarray(dataset.x_train[16:16 + BATCH]), jnp.asarray(dataset.y_train[16:16 + BATCH])
  fns = train.model_fns(model)
  weights = {"initial": fns.init(jax.random.key(0), x[:1])}
  trained = train.train(model, dataset, train.TrainConfig(steps=150, batch_size=BATCH,
                                                         progress=False))
  weights["150 steps"] = (trained.state.params, trained.state.model_state)
  rows = []
  for share in SHARES:
    for label, kw in (("by sensitivity", dict(calibration_batch=calibration)), ("bytes order", {})):
      t0 = time.time()
      p = planner.plan(model, (x_spec, y_spec), share, max_batch=False, **kw)
      seconds = time.time() - t0
      noise = {k: gradient_noise(model, p.techniques, *w, x, y) for k, w in weights.items()}
      rows.append(dict(budget=share, order=label, fits=p.fits, compiles=p.compiles,
                       notes=list(p.notes), device_bytes=p.device_bytes,
                       exact_device_bytes=p.exact_device_bytes,
                       flops_ratio=p.flops / p.exact_flops, noise=noise, seconds=seconds,
                       bits={c.path: c.label for c in p.choices},
                       sensitivity={c.path: c.sensitivity for c in p.choices},
                       # each step compiled (label, bytes, FLOPs), the walk's estimate
                       # (bytes, FLOPs) at every point, what steered the walk, and the walk
                       # as its compiles predict it (Plan.front; not in results written
                       # before this key was added)
                       measured=[list(m) for m in p.measured],
                       estimated=[[float(b), float(f)] for b, f in p.estimates],
                       front=[[float(b), float(f)] for b, f in p.front]))
      print({k: v for k, v in rows[-1].items() if k not in ("estimated", "front")},
            flush=True)
  # GACT's own estimate (1-bit probes) on the same examples, and each site's gradient
  # variance at 4 bits (alone, 8 dithers, the same examples and initial weights) against
  # both predictions, C / 15^2.
  params, loss_fn, batch = calibration_problem_on(model, *calibration, max_values=2**18)
  gact, _ = jmem.surgery.sensitivities(model, loss_fn, params, batch, jmem.ActNN(
      "L3", where="|".join(re.escape(s) for s in rows[0]["bits"])))
  _, init_state = fns.init(jax.random.key(0), batch[0][:1])
  exact = ravel_pytree(jax.grad(lambda p: loss_fn(model, p, batch))(params))[0]
  at4 = {}
  for site in rows[0]["bits"]:
    loss = train.make_loss(train.model_fns(jmem.convert(
        model, jmem.Policy("compress", bits=4, where=re.escape(site)))))
    g = jax.jit(lambda k, loss=loss: ravel_pytree(jax.grad(
        lambda p: loss(p, init_state, *batch, k)[0])(params))[0])
    at4[site] = float(np.mean([float(jnp.sum((g(jax.random.key(50 + s)) - exact) ** 2))
                               for s in range(8)]))
  sites = sorted(rows[0]["bits"])
  short = lambda label: label.replace("compress ", "").replace("recompute_compressed ", "rc ")
  lines = ["# `jmem.plan`: bits ordered by gradient sensitivity against by bytes", "",
           f"Written by `benchmarks/plan_sensitivity.py` ({jax.default_backend()}, JAX "
           f"{jax.__version__}, 2 CPU cores). ResNet-20, digits 32x32, batch {BATCH}, AdamW. "
           "Gradient noise: mean over 16 dither seeds of |g_plan - g_exact|^2 / |g_exact|^2 "
           "on one training batch, at the initial weights and after 150 exact steps. "
           "Device bytes compiled (XLA:CPU).", "",
           "| budget | order | fits | compiles | device MiB (exact) | FLOPs / exact | "
           "noise, initial | noise, 150 steps | " + " | ".join(sites) + " |",
           "|---|---|---|---:|---:|---:|---:|---:|" + "---|" * len(sites)]
  for r in rows:
    lines.append(f"| {r['budget']} | {r['order']} | {'yes' if r['fits'] else 'no'} | "
                 f"{r['compiles']} | "
                 f"{r['device_bytes'] / 2**20:.1f} ({r['exact_device_bytes'] / 2**20:.1f}) | "
                 f"{r['flops_ratio']:.3f} | {r['noise']['initial']:.2e} | "
                 f"{r['noise']['150 steps']:.2e} | " +
                 " | ".join(short(r["bits"][s]) for s in sites) + " |")
  sens = rows[0]["sensitivity"]
  lines += ["", "Sensitivity C per site (initial weights, 16 examples), measured at 2 bits "
            "(what the planner uses) and by GACT's 1-bit estimate, and how each predicts the "
            "site's measured gradient variance at 4 bits (alone; mean over 8 dithers): "
            "measured / (C / 15^2).", "",
            "| site | C at 2 bits | C, GACT 1-bit | variance at 4 bits | measured / 2-bit "
            "prediction | measured / 1-bit prediction |", "|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {s} | {sens[s]:.3g} | {gact[s]:.3g} | {at4[s]:.3g} | "
            f"{at4[s] / (sens[s] / 225):.2f} | {at4[s] / (gact[s] / 225):.2f} |" for s in sites]
  lines += ["", "Notes of the plans: " + "; ".join(sorted({n for r in rows for n in r["notes"]}))]
  write_report("plan_sensitivity", dict(rows=rows, batch=BATCH, seeds=SEEDS, gact_1bit=gact,
                                        variance_at_4_bits=at4,
                                        jax=jax.__version__), lines)


if __name__ == "__main__":
  main()
