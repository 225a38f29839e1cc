"""SBP of a stateful site: a module call whose variables (parameters, batch statistics) and
RNG keys travel as arguments, ``pure(state, rngs, x, *rest) -> (y, new_state)``, with ``x``
carrying the nodes along ``axis``. `jmem.convert` builds such a ``pure`` for every module
that `jmem.SBP`'s ``where=`` selects (linen and NNX); this module is plain JAX.

What the backward re-runs, and what the forward saves:

* ``"nodes"`` (a per-node module: a per-frame CNN): the forward runs ``pure`` on every node
  and saves only the kept slice of ``x`` (plus ``state`` and ``rest``); the backward re-runs
  it on the kept nodes and takes the kept rows of the output cotangent. Dropped nodes get
  no gradient, parameters get the kept nodes' only (`jmem.ops.sbp.sbp`'s rule).
* ``"rows"`` (a block that mixes nodes, such as a transformer block over tokens): the
  forward saves ``x``; the backward re-runs the block on every node with the dropped rows
  of the cotangent at zero, and every recognised attention layer in it computes the kept
  queries only, against the keys and values of all nodes (`jmem.ops.sbp.sbp_rows`'s rule).

Both are the exact gradients of the same loss with the dropped nodes' outputs held constant
(``stop_gradient``), with one more approximation where the site holds BatchNorm layers in
training mode: their batch statistics couple the nodes, so the forward records each layer's
all-node statistics on a `Tape` and the backward normalises with them as constants (the
reference: ``stop_gradient`` on the statistics). The running statistics are updated from
the all-node forward, as without SBP.

The Flax side (which layers are BatchNorm or attention, and what they do with the tape)
belongs to `jmem.surgery`: it reads `active_tape` inside each such layer's call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem.ops.sbp.core import _check_axis, _scatter, check_keep_ratio, get_sampler, \
    sample_indices

__all__ = ["Tape", "active_tape", "sbp_site", "taped_train_fn", "MODES"]

MODES = ("nodes", "rows")


@dataclasses.dataclass
class Tape:
  """What the layers of one SBP site see while it runs (one per pass).

  Attributes:
    mode: ``"record"`` (the all-node forward) or ``"replay"`` (the backward's re-run).
    stats: per BatchNorm call, in call order, the statistics its forward used.
    axis: the site's node axis; ``node_shape``: the shape of its node input ``x``.
    rows: ``idx`` of the kept nodes while replaying in ``"rows"`` mode, else None.
    mixing: set by a recognised attention layer over the node axis while recording.
    dropout: set by a dropout layer that draws while recording.
  """

  mode: str
  axis: int
  node_shape: tuple
  stats: list = dataclasses.field(default_factory=list)
  rows: Any = None
  mixing: str | None = None
  dropout: str | None = None
  cursor: int = 0

  def record(self, stats) -> None:
    self.stats.append(jax.lax.stop_gradient(stats))

  def next(self):
    if self.cursor >= len(self.stats):
      raise RuntimeError("The SBP re-run called more BatchNorm layers than the forward did: "
                         "the site's module must call the same layers for any node count.")
    self.cursor += 1
    return self.stats[self.cursor - 1]

  def attends_over_nodes(self, queries_shape) -> bool:
    """Whether an attention layer with queries ``[..., L, D]`` attends over the node axis:
    its queries are shaped like the site's input and the nodes are their length axis."""
    n = len(self.node_shape)
    return (self.axis == n - 2 and tuple(queries_shape[:-1]) == tuple(self.node_shape[:-1]))

  def attends_within_nodes(self, queries_shape) -> bool:
    """Whether an attention layer with queries ``[..., L, D]`` keeps each node's tokens to
    themselves: its batch (the leading dims) holds every (example, node) pair, as a
    per-frame attention over ``[B * T, N, D]`` does; a joint attention over the tokens of
    several nodes (``[B, T * N, D]``) does not."""
    lead = math.prod(queries_shape[:-2])
    nodes = math.prod(self.node_shape[:self.axis + 1])
    return lead % nodes == 0


_TAPE: contextvars.ContextVar = contextvars.ContextVar("jmem_sbp_tape", default=None)


def active_tape() -> Tape | None:
  """The tape of the SBP site being traced (None outside one)."""
  return _TAPE.get()


@contextlib.contextmanager
def _taping(tape: Tape | None):
  token = _TAPE.set(tape)
  try:
    yield
  finally:
    _TAPE.reset(token)


def taped_train_fn(train_fn: Callable, eval_fn: Callable) -> Callable:
  """A BatchNorm layer's training-mode function ``(x, scale, bias, mask, shift) -> (y,
  stats)`` under the active tape: recording, it also records ``stats``; replaying, it
  normalises with the recorded statistics through ``eval_fn(x, scale, bias, mean, var)``.
  Outside an SBP site, ``train_fn`` itself."""
  tape = active_tape()
  if tape is None:
    return train_fn

  def fn(x, scale, bias, mask, shift):
    if tape.mode == "record":
      y, stats = train_fn(x, scale, bias, mask, shift)
      tape.record(stats)
      return y, stats
    # The forward's statistics, held constant (the re-run's running averages are discarded).
    stats = tape.next()
    return eval_fn(x, scale, bias, stats.mean, stats.var), stats
  return fn


def _zero_cotangent(v):
  if jnp.issubdtype(v.dtype, jnp.inexact):
    return jnp.zeros(v.shape, v.dtype)
  return np.zeros(v.shape, jax.dtypes.float0)


def _run(pure, tape: Tape, state, rngs, x, rest):
  with _taping(tape):
    out = pure(state, rngs, x, *rest)
  if tape.mode == "replay" and tape.cursor != len(tape.stats):
    raise RuntimeError("The SBP re-run called fewer BatchNorm layers than the forward did: "
                       "the site's module must call the same layers for any node count.")
  return out


def sbp_site(pure: Callable, *, keep_ratio: float, axis: int, sampler: Any = "uniform_chunk",
             mode: str | None = None, where: str = "",
             on_backward: Callable[[], None] | None = None) -> Callable:
  """``pure(state, rngs, x, *rest) -> (y, new_state)`` with SBP over the nodes of ``x``.

  Args:
    pure: the site; ``y`` (every leaf) has the nodes along ``axis`` too.
    keep_ratio: fraction of nodes that get a backward pass, in (0, 1].
    axis: node axis of ``x`` and of ``y``.
    sampler: as `jmem.ops.sbp.sbp`'s.
    mode: ``"nodes"``, ``"rows"`` or None (``"rows"`` if a recognised attention layer
      attends over the nodes, else ``"nodes"``); module docstring.
    where: the site's module path, for error messages.
    on_backward: called when the site is differentiated (traced for a backward pass).

  Returns:
    ``g(state, rngs, x, *rest, key) -> (y, new_state)``: the forward equals ``pure``'s.
  """
  check_keep_ratio(keep_ratio)
  if mode not in (None, *MODES):
    raise ValueError(f"SBP mode must be one of {MODES} or None (automatic), got {mode!r}.")
  sampler_fn = get_sampler(sampler)

  def g(state, rngs, x, *rest, key):
    ax = _check_axis(axis, x.ndim)
    idx = jax.lax.stop_gradient(
        sample_indices(key, x, keep_ratio=keep_ratio, axis=ax, sampler=sampler_fn))
    return _site_call(pure, ax, mode, where, on_backward)(state, rngs, x, tuple(rest), idx)

  return g


def _site_call(pure, axis, mode, where, on_backward):
  decided = {}        # what fwd found, for bwd (Python values are no residuals)

  def record(state, rngs, x, rest):
    tape = Tape("record", axis, x.shape)
    out = _run(pure, tape, state, rngs, x, rest)
    for leaf in jax.tree.leaves(out[0]):
      if leaf.ndim <= axis or leaf.shape[axis] != x.shape[axis]:
        raise ValueError(
            f"jmem.SBP: the site {where or '<top>'!r} returns an output of shape {leaf.shape} "
            f"for {x.shape[axis]} nodes along axis {axis} of its input {x.shape}: a site must "
            "return its nodes along the same axis (put the reduction over the nodes - a mean "
            "over frames - outside the module that where= names).")
    return out, tape

  @jax.custom_vjp
  def call(state, rngs, x, rest, idx):
    return record(state, rngs, x, rest)[0]

  def fwd(state, rngs, x, rest, idx):
    if on_backward is not None:
      on_backward()
    out, tape = record(state, rngs, x, rest)
    chosen = mode or ("rows" if tape.mixing else "nodes")
    if chosen == "nodes" and tape.mixing:
      raise ValueError(
          f"jmem.SBP: the site {where or '<top>'!r} was declared per-node (mode='nodes') but "
          f"{tape.mixing} attends over its node axis; use mode='rows' (or leave mode=None).")
    if chosen == "nodes" and tape.dropout:
      raise ValueError(
          f"jmem.SBP: {tape.dropout} draws inside the per-node site {where or '<top>'!r}; its "
          "backward re-runs the kept nodes only, which would draw other dropout masks than "
          "the forward. Turn that dropout off, move it out of the site, or use mode='rows'.")
    stats = tape.stats

    def replay(state, x_in, rest):
      t = Tape("replay", axis, x.shape, stats=list(stats),
               rows=idx if chosen == "rows" else None)
      return _run(pure, t, state, rngs, x_in, rest)[0]

    x_in = jnp.take(x, idx, axis=axis) if chosen == "nodes" else x
    # Traced now (inside the layers' interception), run in the backward: only the inputs of
    # the checkpointed re-run are saved.
    try:
      _, vjp_fn = jax.vjp(jax.checkpoint(replay, prevent_cse=True), state, x_in, rest)
    except Exception as e:  # pylint: disable=broad-except
      if chosen != "nodes":     # the forward ran on every node: the count is what changed
        raise
      raise ValueError(
          f"jmem.SBP: re-running the site {where or '<top>'!r} on its {x_in.shape[axis]} kept "
          f"of {x.shape[axis]} nodes (axis {axis}) failed: {e}\nA per-node site must work for "
          "any number of nodes; one that fixes the count (a reshape to a constant number of "
          "frames) can run with mode='rows' (the re-run takes every node, the dropped ones' "
          "cotangent at zero), or name an inner module with where=.") from e
    decided.update(mode=chosen,
                   rngs=jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), rngs))
    return out, (vjp_fn, idx)

  def bwd(res, cotangent):
    vjp_fn, idx = res
    chosen = decided["mode"]
    dy, _ = cotangent                     # the new state (batch statistics) has none
    n = jax.tree.leaves(dy)[0].shape[axis]
    if chosen == "nodes":
      dy_in = jax.tree.map(lambda d: jnp.take(d, idx, axis=axis), dy)
    else:
      keep = jnp.zeros((n,), bool).at[idx].set(True)
      shape = lambda d: (1,) * axis + (n,) + (1,) * (d.ndim - axis - 1)
      dy_in = jax.tree.map(lambda d: jnp.where(keep.reshape(shape(d)), d, 0), dy)
    d_state, dx, d_rest = vjp_fn(dy_in)
    if chosen == "nodes":
      dx = _scatter(dx, idx, axis, n)
    return (d_state, jax.tree.map(_zero_cotangent, decided["rngs"]), dx, d_rest,
            np.zeros(idx.shape, jax.dtypes.float0))

  call.defvjp(fwd, bwd)
  return call
