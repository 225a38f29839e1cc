"""What is live at the peak of a ResNet-50 train step, buffer by buffer (issue 16's account).

Writes benchmarks/results/peak_account.{json,md}. Compile-only on CPU:

  python benchmarks/peak_account.py [--batch-size 16] [--image-size 224]

For the third-party ResNet-50 (tests/third_party_models.py: an inline stem with
``nn.max_pool``, its own BatchNorm subclass) exact, `jmem.Remat` and `jmem.ActNN("L3")`, and
for jmem's own ResNet-50 exact and ActNN L3 (its stem a compressed site too), the
gradient step is compiled with XLA's buffer-assignment dump and `jmem.measure.peak_buffers`
reads what is live at the peak of the heap: bytes per pass (arguments, forward residuals,
backward working set, unnamed XLA buffers), per layer, and the largest buffers.
"""

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

from _common import RESULTS
import jmem
from jmem import measure, models, train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import third_party_models as tp  # noqa: E402  pylint: disable=g-import-not-at-top

MIB = 2**20


def account(model, batch, size):
  fns = train.model_fns(model)
  x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  params, state = jax.eval_shape(lambda x: fns.init(jax.random.key(0), x), x)
  loss = train.make_loss(fns)
  step = measure.jit(jax.grad(lambda p, s, x, y: loss(p, s, x, y, jax.random.key(3))[0]))
  report = measure.peak_buffers(step, params, state, x, y)
  temp = measure.compiled_memory(step, params, state, x, y).temp_bytes
  return report, temp


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--image-size", type=int, default=224)
  args = p.parse_args()
  base = tp.resnet50(1000)
  own = models.create_model("resnet50", 1000)
  cases = [("exact", base), ("Remat", jmem.convert(base, jmem.Remat())),
           ("ActNN L3", jmem.convert(base, jmem.ActNN("L3"))),
           # jmem's own ResNet-50: its stem (conv, norm, ReLU, max pool) is a site too.
           ("jmem ResNet-50, exact", own),
           ("jmem ResNet-50, ActNN L3", jmem.convert(own, jmem.ActNN("L3")))]
  rows, md = [], ["# What is live at the peak: ResNet-50 (third-party and jmem's)", "",
                  f"Written by `benchmarks/peak_account.py` ({jax.default_backend()}, JAX "
                  f"{jax.__version__}, compile-only): the gradient of the loss at batch "
                  f"{args.batch_size}, {args.image_size}x{args.image_size}, read from XLA's "
                  "live ranges by `jmem.measure.peak_buffers`. Kinds: `argument` (weights, "
                  "input), `forward` (made in the forward pass, still live: residuals, "
                  "compressed or not), `backward` (the backward pass's working set and the "
                  "gradients), `other` (buffers XLA made without a name; the layer that "
                  "first reads them is given).", ""]
  for label, model in cases:
    report, temp = account(model, args.batch_size, args.image_size)
    kinds = report.by("kind")
    scopes = list(report.by("scope").items())[:8]
    rows.append(dict(technique=label, temp_bytes=temp, peak_live_bytes=report.total_bytes,
                     peak_position=report.position, by_kind=kinds, top_scopes=scopes,
                     buffers=[dict(bytes=b.bytes, shape=b.shape, kind=b.kind, scope=b.scope,
                                   op=b.op) for b in sorted(report.buffers,
                                                            key=lambda b: -b.bytes)[:25]]))
    print(label, {k: round(v / MIB, 1) for k, v in kinds.items()}, flush=True)
    md += [f"## {label}", "",
           f"temp {temp / MIB:.1f} MiB; live at the peak {report.total_bytes / MIB:.1f} MiB: "
           + ", ".join(f"{k} {v / MIB:.1f}" for k, v in kinds.items()), "",
           "Largest layers at the peak: " + "; ".join(
               f"{s or '(top level)'} {v / MIB:.1f} MiB" for s, v in scopes), "",
           report.table(12), ""]
  out = dict(batch_size=args.batch_size, image_size=args.image_size, rows=rows,
             jax=jax.__version__, backend=jax.default_backend())
  os.makedirs(RESULTS, exist_ok=True)
  with open(os.path.join(RESULTS, "peak_account.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(RESULTS, "peak_account.md"), "w") as f:
    f.write("\n".join(md))
  print("\n".join(md))


if __name__ == "__main__":
  main()
