"""SyncBN on 8 devices, checked against plain BatchNorm: run it as it is.

  python examples/sync_bn.py             # on a CPU: 8 simulated devices
  python examples/sync_bn.py --mistake   # a per-device mean loss, its gradients averaged

A linen CNN with Flax's own ``nn.BatchNorm`` is converted with ``jmem.SyncBN`` and trained
data-parallel under ``jax.shard_map``, each device holding 4 rows of a 32-row batch of which
only some are real (the rest padding, masked out; two devices hold none). Its loss and
gradients are compared with the plain model's on the real rows alone, on one device: they
agree to 1e-5 in float32.

Two things a first try gets wrong, done right here:
- the inputs are placed on the mesh with the ``in_specs`` they are given
  (``NamedSharding(mesh, P("batch"))``), or ``shard_map`` refuses them;
- the loss is each device's share of the global mean (a sum over its valid rows divided by
  the global count) and the gradients are NOT averaged again: with ``shard_map``'s type
  checks on (``check_vma=True``, the default), JAX's autodiff already sums a replicated
  parameter's gradient over the devices, so a ``pmean`` of it would be 8x too large.
"""

import os
import sys

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import flax.linen as nn  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position
from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top,wrong-import-position

import jmem  # pylint: disable=g-import-not-at-top,wrong-import-position

TOLERANCE = 1e-5


class CNN(nn.Module):
  """Two conv + BatchNorm + relu layers and a classifier: Flax's own layers only."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    for features in (16, 32):
      x = nn.Conv(features, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def per_example_loss(logits, labels):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1)[:, 0]


def main(mistake: bool = False) -> int:
  """Prints the comparison; 0 where SyncBN matched plain BatchNorm to `TOLERANCE`, else 1.

  ``mistake``: each device's loss is the mean over its own valid rows and the gradients
  are then averaged over the devices (``pmean``): what the check must catch.
  """
  devices = len(jax.devices())
  if devices < 8:
    print(f"examples/sync_bn.py needs 8 devices, found {devices}: run it in a fresh Python "
          "(it simulates 8 CPU devices when it imports JAX itself).")
    return 2
  mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.random.normal(jax.random.key(0), (32, 12, 12, 3))
  y = jnp.arange(32) % 10
  real_rows = (4, 0, 1, 3, 4, 2, 0, 2)        # per device, of 4; the rest is padding
  valid = np.concatenate([np.arange(4) < n for n in real_rows])

  model = CNN()
  variables = model.init(jax.random.key(1), x)

  # The reference: plain BatchNorm on the real rows alone, one device.
  def plain_loss(params):
    logits, _ = model.apply({**variables, "params": params}, x[valid], mutable=["batch_stats"])
    return jnp.mean(per_example_loss(logits, y[valid]))
  loss0, grads0 = jax.value_and_grad(plain_loss)(variables["params"])

  # jmem: the same model, its BatchNorm layers synchronised over the mesh axis "batch".
  synced = jmem.convert(model, jmem.SyncBN(axis_name="batch"))

  def device_step(params, x, y, valid):       # runs on each device with its 4 rows
    def loss(params):
      with jmem.batch_mask(valid):            # padding stays out of the statistics
        logits, _ = synced.apply({**variables, "params": params}, x, mutable=["batch_stats"])
      count = jax.lax.psum(jnp.sum(valid), "batch")
      if mistake:
        count = jnp.maximum(jnp.sum(valid), 1)
      return jnp.sum(jnp.where(valid, per_example_loss(logits, y), 0.0)) / count
    share, grads = jax.value_and_grad(loss)(params)
    if mistake:
      return jax.lax.pmean(share, "batch"), jax.lax.pmean(grads, "batch")
    return jax.lax.psum(share, "batch"), grads   # grads: already summed over devices

  step = jax.jit(jax.shard_map(device_step, mesh=mesh,
                               in_specs=(P(), P("batch"), P("batch"), P("batch")),
                               out_specs=(P(), P())))
  on_mesh = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  loss1, grads1 = step(on_mesh(variables["params"], P()), on_mesh(x, P("batch")),
                       on_mesh(y, P("batch")), on_mesh(jnp.asarray(valid), P("batch")))

  loss_err = float(abs(loss1 - loss0))
  # Relative to the largest gradient of all: a convolution's bias before BatchNorm has a
  # gradient of zero in exact arithmetic (BN removes it), so its own scale is rounding.
  largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads0))
  grad_err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0))) / largest
  ok = loss_err <= TOLERANCE * abs(float(loss0)) and grad_err <= TOLERANCE
  print(("[--mistake] " if mistake else "") + f"SyncBN on 8 devices ({sum(real_rows)} real rows of 32; devices 1 and 6 hold none) "
        f"against plain BatchNorm on the real rows: loss {float(loss1):.6f} vs "
        f"{float(loss0):.6f}, largest gradient difference {grad_err:.1e} of the largest "
        f"gradient: {'exact to 1e-5' if ok else 'NOT within 1e-5'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(mistake="--mistake" in sys.argv[1:]))
