"""The README's quickstart runs as written, with a small model of the test's own."""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow     # each test compiles whole steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quickstart() -> str:
  """The one Python block under the README's "Quickstart" heading."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  found = re.search(r"^## Quickstart[^\n]*\n.*?^```python\n(.*?)^```", text, re.S | re.M)
  assert found, "README.md has no ```python block under a '## Quickstart' heading"
  return found.group(1)


class SmallCNN(nn.Module):
  """A plain linen CNN (Flax's own layers; jmem did not write it)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    for features in (8, 16):
      x = nn.Conv(features, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train)(x)
      x = nn.relu(x)
    return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


def test_readme_quickstart_runs_as_written(capsys):
  code = quickstart()
  # What the quickstart leaves to the reader, and only that, is filled in: the model class,
  # one batch and the batches.
  assert code.count("x, y = ...") == 1 and "MyNet()" in code and "in batches:" in code
  code = code.replace("x, y = ...", "x, y = jnp.ones((8, 16, 16, 3)), jnp.arange(8) % 10")
  rng = np.random.default_rng(0)
  batches = [(jnp.asarray(rng.normal(size=(8, 16, 16, 3)), jnp.float32),
              jnp.asarray(rng.integers(0, 10, 8), jnp.int32))]
  scope = {"MyNet": SmallCNN, "batches": batches, "jnp": jnp}
  exec(compile(code, "README.md quickstart", "exec"), scope)  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert printed.strip(), "print(plan) printed nothing"
  # The plan says what its figures assume, so that the user's step matches them.
  assert "compiled with jmem.jit" in printed and "donated" in printed, printed
  assert scope["plan"].techniques is not None
  metrics = scope["metrics"]
  assert bool(jnp.isfinite(metrics["loss"])), metrics
  # The step ran: the state moved on from init's.
  init_state = scope["init"](jax.random.key(0), batches[0][0])
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: jnp.any(a != b), scope["state"].params,
                                       init_state.params))
  assert any(bool(m) for m in moved)
