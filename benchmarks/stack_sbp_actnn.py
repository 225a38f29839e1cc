"""SBP on a per-frame CNN stacked with ActNN on the temporal block after it (issue 16).

A clip model jmem did not write (the third-party ``FrameEncoder`` per frame, then a
residual temporal block of 1-D convolutions over the frames, then a head): `jmem.SBP`
(keep ratio 0.5) on the frame encoder, `jmem.ActNN` (L3 blocks at 8, 4, 2 bits) on the
temporal block. Checks the stack against its approximate parts with the same keys:

* the stack's relative gradient error against SBP alone, next to ActNN alone's against
  exact (the issue's bound: at most 2x at 8 bits);
* at 2 bits, 64 rounding keys: the mean gradient against SBP alone's, projected on random
  directions, in standard errors (|z| < 3: no bias detected at that resolution, about
  3 x error / 8 of the gradient's norm). The 8/4/2-bit errors are from one rounding key each. Per-coordinate z is not used:
  coordinates that the rounding does not touch have zero variance.

Writes ``results/stack_sbp_actnn.{json,md}``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmem  # noqa: E402
import third_party_models as tp  # noqa: E402
from _common import write_report  # noqa: E402


class Clip(nn.Module):
  @nn.compact
  def __call__(self, clips, train: bool = True):
    f = tp.FrameEncoder(name="frames")(clips, train)
    f = tp.TemporalConv(64, name="temporal")(f)
    return nn.Dense(10)(f.reshape(f.shape[0], -1))


def main():
  x = jax.random.normal(jax.random.key(0), (8, 8, 8, 8, 3))
  y = jnp.arange(8)
  model = Clip()
  variables = model.init(jax.random.key(1), x, False)
  state = {k: v for k, v in variables.items() if k != "params"}
  sbp_key = jax.random.key(5)

  def grads(m, actnn_key):
    def loss(p):
      out, _ = m.apply({"params": p, **state}, x, mutable=list(state),
                       rngs={"sbp": sbp_key, "actnn": actnn_key})
      return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), y[:, None], 1))
    g = jax.jit(jax.grad(loss))(variables["params"])
    return jnp.concatenate([a.ravel() for a in jax.tree.leaves(g)])

  def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

  sbp = jmem.SBP(keep_ratio=0.5, axis=1, where=tp.FrameEncoder)
  key = jax.random.key(7)
  g_exact, g_sbp = grads(model, key), grads(jmem.convert(model, sbp), key)
  res = {"errors": []}
  for bits in (8, 4, 2):
    act = jmem.ActNN(bits=bits, where=tp.TemporalConv)
    res["errors"].append({"bits": bits,
                          "actnn_alone": rel(grads(jmem.convert(model, act), key), g_exact),
                          "sbp_actnn_vs_sbp": rel(grads(jmem.convert(model, sbp, act), key),
                                                  g_sbp)})
  stack = jmem.convert(model, sbp, jmem.ActNN(bits=2, where=tp.TemporalConv))
  gs = jnp.stack([grads(stack, jax.random.key(100 + i)) for i in range(64)])
  res["z_2bit_64_keys"] = []
  for j in range(3):
    d = jax.random.normal(jax.random.key(900 + j), (gs.shape[1],))
    u = gs @ d
    res["z_2bit_64_keys"].append(float(jnp.abs(u.mean() - g_sbp @ d) /
                                       (u.std(ddof=1) / jnp.sqrt(64.0))))
  lines = ["# SBP (r=0.5, frame encoder) + ActNN (temporal block)", "",
           f"jax {jax.__version__}, {jax.devices()[0].platform}; clips 8x8 frames of 8x8x3.", "",
           "| bits | ActNN alone vs exact | SBP+ActNN vs SBP | ratio |", "|---:|---:|---:|---:|"]
  for e in res["errors"]:
    lines.append(f"| {e['bits']} | {e['actnn_alone']:.2e} | {e['sbp_actnn_vs_sbp']:.2e} | "
                 f"{e['sbp_actnn_vs_sbp'] / e['actnn_alone']:.2f} |")
  e2 = res["errors"][-1]["sbp_actnn_vs_sbp"]
  lines += ["", "2 bits, 64 rounding keys, mean gradient vs SBP alone on 3 random directions: "
            "z = " + ", ".join(f"{z:.2f}" for z in res["z_2bit_64_keys"]) +
            f" (|z| < 3: no bias detected; one SE is about {e2:.2f}/8 of the gradient's "
            f"norm, so a bias above ~{3 * e2 / 8:.0%} of it would show)."]
  write_report("stack_sbp_actnn", res, lines)


if __name__ == "__main__":
  main()
