"""Accuracy of `jmem.plan`'s plans for the segmentation model and the video transformer
(`plan_models.md`), trained next to exact on the embedded data, as `jmem plan
--verify-steps` does for the registered models (the third-party ViT is not one; the U-Net
is, as ``unet``, with this data, `jmem.data.digit_segmentation`):

* the U-Net plan for 1024x2048 at batch 1 in 6 GiB (8-bit compression at 8 of its 10
  sites), on the U-Net with 11 classes trained to segment the digits at 32x32: each pixel
  is labelled with its digit where it is ink (over one standard deviation above the mean
  intensity), else background (class 10);
* the third-party video ViT plan for 16x112² at batch 8 in 2 GiB (8-bit compression at
  6 of its 8 blocks), on the same ViT (patch 16, width 384, 8 blocks, 6 heads) trained on the
  moving-digits clips (8 frames of 32x32, one direction: the label is the digit; with 4
  directions, 40 classes, neither model learned in 200 steps: 3.9% and 4.3%), 300 steps
  at a learning rate of 3e-4.

Each run: the exact model and the planned one (the plan's policies, its site paths being
the same at this size), the same seeds and batches, `jmem.train`'s AdamW. Reports test
accuracy (for the U-Net: pixel accuracy, and mean IoU over the 10 digit classes). Writes
results/plan_verify_models.{json,md}.

  python benchmarks/plan_verify_models.py [--steps N (both)] [--seeds 0,1,2] [--only ViT]

``--only TEXT`` reruns the cases whose name contains TEXT and keeps the other cases' rows
from results/plan_verify_models.json, where their plan's policies are still
plan_models.json's (else it stops: rerun them too).
"""

import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jmem  # noqa: E402
import third_party_models as tp  # noqa: E402
from jmem import data, train  # noqa: E402
from jmem.models.segmentation import UNet  # noqa: E402
from _common import RESULTS, parser, write_report  # noqa: E402

def mean_iou(fns, state, x, y, classes) -> float:
  """Mean over ``classes`` of intersection over union on ``x, y`` (eval mode)."""
  predict = jax.jit(lambda p, s, v: jnp.argmax(fns.apply(p, s, v, train=False)[0], -1))
  pred = np.concatenate([np.asarray(predict(state.params, state.model_state, x[i:i + 128]))
                         for i in range(0, len(x), 128)])
  ious = []
  for c in classes:
    union = np.sum((pred == c) | (y == c))
    if union:
      ious.append(np.sum((pred == c) & (y == c)) / union)
  return float(np.mean(ious))


def plan_policies(case: str) -> tuple:
  """The policies of the plan ``case`` of results/plan_models.json."""
  with open(os.path.join(RESULTS, "plan_models.json")) as f:
    plan = next(r["plan"] for r in json.load(f) if r["case"] == case)
  return tuple(jmem.Policy(c["kind"], bits=c["bits"], where=re.escape(c["path"]))
               for c in plan["choices"] if c["kind"] != "save")


def main():
  p = parser(__doc__.split("\n")[0])
  p.set_defaults(seeds=(0, 1, 2), steps=None)
  p.add_argument("--only", default=None, help="rerun only the cases whose name contains it")
  args = p.parse_args()
  cases = [   # name, plan, model, data, batch, steps, learning rate
      ("U-Net, digit segmentation 32x32", "U-Net 1024x2048, batch 1", lambda: UNet(11),
       data.digit_segmentation(32), 32, 200, 1e-3),
      ("video ViT, moving digits 8x32x32", "video ViT 16x112x112, batch 8",
       lambda: tp.FrameTokenViT(patch=16, dim=384, depth=8, heads=6, num_classes=10),
       data.moving_digits(8, frame_size=32, num_directions=1), 32, 300, 3e-4),
  ]
  rows, md = [], ["# `jmem.plan`'s plans for the U-Net and the video ViT, trained next to exact",
                  "", f"Written by `benchmarks/plan_verify_models.py` ({jax.default_backend()}, "
                  f"JAX {jax.__version__}, {os.cpu_count()} CPU cores), seeds "
                  f"{list(args.seeds)}. The plans are `plan_models.md`'s; their policies are "
                  "applied to the same model trained at a size the embedded data has. Test "
                  "accuracy is pixel accuracy for the U-Net; its mIoU is over the 10 digit "
                  "classes (the background's IoU is near 1 for every model).", "",
                  "| model, data | plan | steps | seed | exact accuracy | plan accuracy | "
                  "exact mIoU | plan mIoU | seconds |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  kept = []
  if args.only:
    with open(os.path.join(RESULTS, "plan_verify_models.json")) as f:
      kept = [r for r in json.load(f) if args.only not in r["case"]]
  for name, case, make, ds, batch, steps, lr in cases:
    steps = args.steps or steps
    policies = plan_policies(case)
    label = ", ".join(sorted({t.kind + (f" {t.bits}-bit" if t.bits else "")
                              for t in policies})) + f" at {len(policies)} sites"
    old = [r for r in kept if r["case"] == name]
    if old and any(r["policies"] != [repr(t) for t in policies] for r in old):
      raise SystemExit(f"{name}: plan_models.json's plan changed since its rows were trained: "
                       "rerun it (no --only, or --only naming it)")
    for out in old:
      rows.append(out)
      md.append(_md_row(out, name, label))
    for seed in () if old else args.seeds:
      config = train.TrainConfig(steps=steps, batch_size=batch, learning_rate=lr, seed=seed,
                                 progress=False)
      out = dict(case=name, plan=case, policies=[repr(t) for t in policies], seed=seed,
                 steps=steps, learning_rate=lr)
      t0 = time.time()
      for which, model in (("exact", make()), ("plan", jmem.convert(make(), *policies))):
        result = train.train(model, ds, config)
        out[which] = dict(accuracy=result.test_accuracy)
        if ds.y_test.ndim > 1:         # the digits' classes: background is near 1 for all
          out[which]["miou"] = mean_iou(train.model_fns(model), result.state, ds.x_test,
                                        ds.y_test, range(data.BACKGROUND))
      out["seconds"] = time.time() - t0
      rows.append(out)
      md.append(_md_row(out, name, label))
      print(md[-1], flush=True)
  write_report("plan_verify_models", rows, md)


def _md_row(out, name, label):
  miou = lambda w: f"{out[w]['miou']:.3f}" if "miou" in out[w] else "-"
  return (f"| {name} | {label} | {out['steps']} | {out['seed']} | "
          f"{100 * out['exact']['accuracy']:.2f}% | {100 * out['plan']['accuracy']:.2f}% | "
          f"{miou('exact')} | {miou('plan')} | {out['seconds']:.0f} |")


if __name__ == "__main__":
  main()
