"""Exact, smaller residuals for the ops that run between a model's sites.

A model someone else wrote often calls activations and pooling inline in a module's
``__call__`` (a ResNet stem: ``nn.relu(bn(conv(x)))`` then ``nn.max_pool``), outside every
module a technique converts. Their residuals then stay as JAX saves them: the float input
of each ReLU (its derivative's mask is fused into the backward pass, so XLA keeps the
float) and the padded input of each max pool (read by ``select_and_scatter``). On
flaxmodels' ResNet50 under ActNN L3, replacing them took the train step from 20.4 to 13.0
MiB per example on the H100 target (docs/decisions.md).

`compact_between_sites` re-evaluates a function with each of those ops replaced by one
whose backward reads less, for the same values and the same gradient: ``jax.nn.relu`` (and
so ``flax.linen.relu``, ``flax.nnx.relu``) saves a 1-bit mask packed eight per byte
(`jmem.ops.actnn.compressed_ops.relu`), a max pool the uint8 index of each window's maximum
(`jmem._window.indexed_max_pool`; a window holding a NaN sends its gradient to another
position than ``select_and_scatter`` does). Nothing else changes: the sites (custom_vjp calls),
other activations and every other equation are bound as they are.
"""

# The jaxpr helpers are quantize's (the sites' max-pool rewrite uses the same ones).
# pylint: disable=protected-access

from __future__ import annotations

import functools

import jax

from jmem import _window
from jmem.ops.actnn import compressed_ops
from jmem.ops.actnn import quantize as q

__all__ = ["compact_between_sites"]


def _source(eqn) -> str | None:
  call = eqn.params.get("call_jaxpr")
  info = getattr(getattr(call, "jaxpr", call), "debug_info", None)
  return getattr(info, "func_src_info", None)


def _rule(eqn) -> str | None:
  """The custom_jvp's tangent rule traced for its (non-zero) input, as text."""
  try:
    jvp_jaxpr, _, _ = eqn.params["jvp_jaxpr_fun"].call_wrapped(False)
  except Exception:  # pylint: disable=broad-except  (a rule that cannot be traced alone)
    return None
  return str(jvp_jaxpr)


@functools.cache
def _relu_reference(aval) -> tuple:
  """``jax.nn.relu``'s (function source, tangent rule) at ``aval`` (with the mesh axes it
  varies over under shard_map, which its rule's text shows)."""
  eqn = jax.make_jaxpr(jax.nn.relu)(aval).jaxpr.eqns[0]
  return _source(eqn), _rule(eqn)


def _is_relu(eqn) -> bool:
  """Whether ``eqn`` is ``jax.nn.relu``: its function (by where it is defined) and its
  tangent rule. A custom_jvp of another derivative around the same function (a
  straight-through ReLU, ``jax.custom_jvp(jax.nn.relu)`` with a rule of its own) is not."""
  if eqn.primitive.name != "custom_jvp_call" or len(eqn.invars) != 1:
    return False
  source, rule = _relu_reference(eqn.invars[0].aval)
  return _source(eqn) == source and _rule(eqn) == rule


def _replaceable(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jit call inside it) has an op `compact_between_sites` takes."""
  for eqn in jaxpr.eqns:
    inner, _ = q._inner(eqn)
    if _is_relu(eqn) or q._indexable(eqn) or (inner is not None and _replaceable(inner)):
      return True
  return False


def compact_between_sites(f):
  """``f`` with its ReLUs (``jax.nn.relu``) saving a 1-bit mask and its max pools (floating,
  undilated, at most 256 positions per window) a uint8 index, at its top level and inside
  the ``jax.jit`` calls there; the same values and gradients. Sites and other
  higher-order calls (custom_vjp, ``jax.checkpoint``, ``scan``, ``shard_map``) are left as
  they are. ``f`` is traced once and its jaxpr evaluated (as ``jax.core.eval_jaxpr``
  would, keeping each equation's name scope)."""

  def g(*args):
    flat, tree = jax.tree.flatten(args)
    box = {}

    def flat_f(*flat):
      out = f(*jax.tree.unflatten(tree, flat))
      leaves, box["tree"] = jax.tree.flatten(out)
      return leaves

    # ``f`` runs once, traced here; the jaxpr is then evaluated in the caller's trace, even
    # with nothing to replace: a second call could draw other random numbers, and values
    # ``f`` caches while tracing (a site's key) belong to this trace.
    closed = jax.make_jaxpr(flat_f)(*flat)
    return jax.tree.unflatten(box["tree"], _evaluate(closed.jaxpr, closed.consts, flat))
  return g


def _evaluate(jaxpr, consts, args):
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if q._literal(v) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner, inner_consts = q._inner(eqn)
    if _is_relu(eqn):
      outs = q._bind(eqn, ins, lambda x: [compressed_ops.relu(x)])
    elif q._indexable(eqn):
      p = eqn.params
      outs = q._bind(eqn, ins, lambda x: [_window.indexed_max_pool(
          x, p["window_dimensions"], p["window_strides"], p["padding"])])
    elif inner is not None and _replaceable(inner):
      outs = q._bind(eqn, ins, lambda *a: _evaluate(inner, inner_consts, a))
    else:
      outs = q._bind(eqn, ins)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]
