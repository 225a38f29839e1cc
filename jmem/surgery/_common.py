"""What the linen and NNX engines of `jmem.convert` share: recognising BatchNorm and
activations, the batch mask and RNG contexts, the per-site transforms."""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmem import _warn
from jmem._context import (  # pylint: disable=unused-import
    RngStreams, active_mask, batch_mask, context_key, current_rngs, data_key, data_keys,
    mask_for, missing_key, rngs)
from jmem._bn_core import linen_has_bn_variables, nnx_has_bn_stats  # pylint: disable=unused-import
from jmem._elementwise import ABNConfig
from jmem.ops.actnn.technique import ActNN
from jmem.ops.policy import SiteSpec, recomputed, site_transform
from jmem.ops.sbp import sites as sbp_sites
from jmem.ops.sbp.technique import SBP

_WARNED: set = set()


def warn_once(tag: str, message: str, category: type[Warning] = UserWarning) -> None:
  if tag not in _WARNED:
    _WARNED.add(tag)
    _warn.warn(message, category)


def streams_of(techniques) -> tuple[str, ...]:
  """The RNG streams the sites of ``techniques`` draw from in training: ``"actnn"`` for
  ActNN and quantizing policies, ``"sbp"`` for SBP."""
  out = set()
  for t in techniques:
    if isinstance(t, SBP):
      out.add("sbp")
    elif isinstance(t, ActNN) or getattr(t, "bits", None) is not None:
      out.add("actnn")
  return tuple(sorted(out))


def missing_actnn_key(path: str, streams=None):
  """`jmem._context.missing_key` for an ActNN (or quantizing policy) site."""
  return missing_key("actnn", path, "compressing site (stochastic rounding)", streams)


def missing_sbp_key(path: str, streams=None):
  """`jmem._context.missing_key` for an SBP site."""
  return missing_key("sbp", path, "SBP site (the nodes it keeps)", streams)


# ---------------------------------------------------------------- recognising BatchNorm

LINEN_BN_FIELDS = ("use_running_average", "axis", "momentum", "epsilon", "use_scale", "use_bias",
                   "scale_init", "bias_init", "param_dtype", "dtype")
NNX_BN_ATTRS = ("mean", "var", "scale", "bias", "use_running_average", "axis", "momentum",
                "epsilon")


def overrides_call(module, base: type) -> bool:
  """``module`` is a ``base`` subclass with its own ``__call__``."""
  return type(module).__call__ is not base.__call__


def linen_bn_status(module) -> str | None:
  """``"bn"`` (nn.BatchNorm or a subclass keeping its __call__), ``"override"`` (a subclass
  with its own __call__), or None."""
  if isinstance(module, nn.BatchNorm):
    return "override" if overrides_call(module, nn.BatchNorm) else "bn"
  return None


def nnx_bn_status(module) -> str | None:
  if isinstance(module, nnx.BatchNorm):
    return "override" if overrides_call(module, nnx.BatchNorm) else "bn"
  if nnx_has_bn_stats(module):
    return "lookalike"
  return None


# ---------------------------------------------------------------- recognising activations

def _leaky_fns():
  return {jax.nn.leaky_relu, nn.leaky_relu, nnx.leaky_relu}


def _elu_fns():
  return {jax.nn.elu, nn.elu, nnx.elu}


def _relu_fns():
  return {jax.nn.relu, nn.relu, nnx.relu, jax.nn.relu6, nn.relu6, jax.nn.gelu, nn.gelu,
          jax.nn.silu, nn.silu, nn.swish, jax.nn.sigmoid, nn.sigmoid}


def activation_of(fn) -> tuple[str, dict] | None:
  """``("leaky_relu", {"slope": s})``, ``("elu", {"alpha": a})``, ``("other", {"name": n})``
  for any other plain function (an activation InPlace-ABN does not support), or None for
  anything else (a module)."""
  base, args, kwargs = fn, (), {}
  if isinstance(fn, functools.partial):
    base, args, kwargs = fn.func, fn.args, dict(fn.keywords)
  try:
    if base in _leaky_fns():
      slope = args[0] if args else kwargs.get("negative_slope", 0.01)
      return "leaky_relu", {"slope": float(slope)}
    if base in _elu_fns():
      alpha = args[0] if args else kwargs.get("alpha", 1.0)
      return "elu", {"alpha": float(alpha)}
    if base in _relu_fns():
      return "other", {"name": getattr(base, "__name__", repr(base)), "known": True}
  except TypeError:   # unhashable callables
    return None
  if callable(base) and not isinstance(base, (nn.Module, nnx.Module)):
    return "other", {"name": getattr(base, "__name__", repr(base))}
  return None


def abn_config(technique, pair: tuple[str, dict] | None, path: str, epsilon: float,
               axis_name, axis_index_groups) -> ABNConfig:
  """The ABN configuration of a site: the pair's activation checked against the
  technique's."""
  from jmem.ops.inplace_abn.core import _config  # pylint: disable=g-import-not-at-top
  where = path or "<top>"
  if pair is None:
    if technique.activation == "identity":
      act, opts = "identity", {}
    else:
      raise ValueError(
          f"InPlaceABN: the BatchNorm at {where!r} is not followed by an activation jmem can "
          "see (the model applies it in its own code, or applies none). jmem recognises a "
          "BatchNorm followed by leaky_relu/elu in an nn.Sequential / nnx.Sequential. Either "
          "replace the pair in the model by one module - jmem.ops.inplace_abn.InPlaceABN "
          "(linen) or jmem.ops.NNXInPlaceABN, which take BatchNorm's arguments plus "
          "activation=, slope=, alpha= - or leave this BatchNorm out with where= (a regular "
          "expression over module paths), or use InPlaceABN(activation='identity') for "
          "BatchNorm alone.")
  elif pair[0] == "other":
    raise ValueError(
        f"InPlaceABN: the BatchNorm at {where!r} is followed by {pair[1]['name']}, which "
        f"{'is not invertible' if pair[1].get('known') else 'InPlace-ABN does not support'}"
        "; InPlace-ABN recovers the activation's input from its output, so it needs "
        "leaky_relu (slope > 0) or elu. Change the model's activation there, or leave this "
        "BatchNorm out with where=.")
  else:
    act, opts = pair
  if technique.activation not in (None, act):
    raise ValueError(f"InPlaceABN(activation={technique.activation!r}) but the BatchNorm at "
                     f"{where!r} is followed by {act}: the site computes what the model "
                     "computes, so give the model's activation (or None).")
  slope = opts.get("slope", 0.01)
  alpha = opts.get("alpha", 1.0)
  for name, mine, given in (("slope", slope, technique.slope), ("alpha", alpha, technique.alpha)):
    if given is not None and opts.get(name) is not None and float(given) != mine:
      raise ValueError(f"InPlaceABN({name}={given}) but the model's activation at {where!r} "
                       f"has {name}={mine}.")
  return _config(act, slope, alpha, epsilon, axis_name, axis_index_groups)


# ---------------------------------------------------------------- per-site transforms

def block_spec(found, path: str) -> SiteSpec:
  """The `SiteSpec` of the block techniques ``found`` (``[(index, technique, kind)]``, not
  SBP) that select one site: one of them, or `Remat` with an `ActNN` (recompute from a
  compressed input, at ActNN's bits, group size and offload). Raises for any other pair."""
  policies = [f for f in found if f[2] == "policy"]
  remats = [f for f in found if f[2] == "remat"]
  compressions = [f for f in found if f[2] in ("block", "conv", "norm")]
  if len(found) > 1:
    if policies:
      pair = (policies[0], next(f for f in found if f is not policies[0]))
      why = ("a Policy says all that its site keeps (combine recompute and compression with "
             "Policy('recompute_compressed', bits=...))")
    elif len(remats) > 1 or len(compressions) > 1:
      pair = remats[:2] if len(remats) > 1 else compressions[:2]
      why = f"{stacking_note(pair[0][2], pair[1][2])} is not supported"
    else:
      pair = None
    if pair is not None:
      raise ValueError(f"Both {pair[0][1]!r} and {pair[1][1]!r} select the module at "
                       f"{path or '<top>'!r}: {why}; give the techniques disjoint where=.")
  spec = SiteSpec()
  for _, t, kind in found:
    if kind == "policy":
      spec = t.spec()
    elif kind == "remat":
      spec = dataclasses.replace(spec, recompute=True, checkpoint_policy=t.policy)
    else:
      lv = t.resolved_level()
      spec = dataclasses.replace(spec, bits=site_bits(lv, kind, path), group_size=lv.group_size,
                                 offload=lv.offload, implementation=t.implementation)
  return spec


def nested_site(found, path: str, enclosing):
  """``(found, spec)`` of a block site inside the block sites ``enclosing`` (``[(found,
  spec, path)]``, outermost first; ``spec`` None for SBP), or None where they cover it.

  A technique that also takes an enclosing site covers this one there (``where=`` matched
  both): it is dropped here, and the site is covered once nothing is left. What is left
  applies inside the enclosing sites, where that is sound: a recomputation inside a
  compressing site recomputes from the compressed residuals, so it keeps the masks and
  statistics of its forward pass exact (`jmem.ops.policy.save_masks_and_statistics`), as a
  site recomputing from its own compressed input does. Raised: SBP mixed with another kind;
  a compressed or offloaded site inside a site that stores every residual inside it
  already (no recomputation); a ``"save"`` site inside any other kind (its residuals are
  stored or recomputed by the enclosing site, not kept as they are).
  """
  taken = {i for outer_found, _, _ in enclosing for i, _, _ in outer_found}
  left = [f for f in found if f[0] not in taken]
  if not left:
    return None
  sbp = any(kind == "sbp" for _, _, kind in left)
  spec = None if sbp else block_spec(left, path)
  from_compressed = False
  for outer_found, outer_spec, outer_path in enclosing:
    kind, other = left[0][2], outer_found[0][2]
    if (spec is None) != (outer_spec is None):
      raise ValueError(
          f"The {kind} site {path!r} is inside the {other} site {outer_path or '<top>'!r}: "
          f"{stacking_note(kind, other)} is not implemented yet; give the techniques "
          "disjoint where=.")
    if spec is None:
      return None                     # SBP inside SBP: the enclosing site's nodes
    if spec.name == "save" and outer_spec.name != "save":
      raise ValueError(
          f"The save site {path!r} is inside the {outer_spec.name} site "
          f"{outer_path or '<top>'!r}, which stores or recomputes every residual inside it, so "
          "they cannot be kept as they are; give the techniques disjoint where=.")
    if outer_spec.stores and not outer_spec.recompute:
      if spec.stores:
        raise ValueError(
            f"The {spec.name} site {path!r} is inside the {outer_spec.name} site "
            f"{outer_path or '<top>'!r}, which already stores every residual inside it "
            f"{'compressed' if outer_spec.bits is not None else 'offloaded'}; storing them "
            "twice is not supported: give the techniques disjoint where=.")
      from_compressed = from_compressed or outer_spec.bits is not None
  if from_compressed and spec.recompute:
    spec = dataclasses.replace(spec, from_compressed=True)
  return left, spec


def probe_of(found):
  """``(probe, group size)`` of the `ActNN` of ``found`` that carries a calibration probe
  (`jmem.surgery.sensitivities`), or None."""
  t = next((t for _, t, _ in found if isinstance(t, ActNN) and t.probe is not None), None)
  return None if t is None else (t.probe, t.resolved_level().group_size)


def block_transform(probe, spec: SiteSpec, key, path: str, missing=None):
  """``pure -> g`` of a block site: the calibration ``probe`` (`probe_of`) if there is
  one, else `site_transform` of ``spec`` (``missing``: its hook for a missing key)."""
  if probe is None:
    return site_transform(spec, key, missing_key=missing)
  probe, group_size = probe
  return lambda pure: probe.site(recomputed(spec, pure), path, group_size=group_size,
                                 arguments_only=spec.keeps_exact)


def needs_key(probe, spec: SiteSpec) -> bool:
  """Whether the site draws a stochastic-rounding key (compresses, and is not probing)."""
  return spec.draws and probe is None


def check_sbp_alone(found, path: str) -> None:
  """Raises if SBP and another block technique select one site."""
  if len(found) > 1 and any(kind == "sbp" for _, _, kind in found):
    raise ValueError(
        f"Both {found[0][1]!r} and {found[1][1]!r} select the module at {path or '<top>'!r}. "
        f"{stacking_note(found[0][2], found[1][2])} is not implemented yet; give the "
        "techniques disjoint where=.")


def sbp_transform(technique, key, path: str, streams=None):
  """``pure -> g`` with SBP over the nodes of the site's first array argument. Without a
  ``key``, differentiating it raises (`missing_sbp_key`: ``streams`` are the model's) unless
  `data_keys` is entered; the forward pass alone draws nothing that is used."""
  def transform(pure):
    g = sbp_sites.sbp_site(pure, keep_ratio=technique.keep_ratio, axis=technique.axis,
                           sampler=technique.sampler, mode=technique.mode, where=path,
                           on_backward=missing_sbp_key(path, streams) if key is None else None)

    def run(state, rngs, x, *rest):
      k = key if key is not None else data_key((x,))
      return g(state, rngs, x, *rest, key=k)
    return run
  return transform


def sbp_attention(tape, path: str, dropout_on: bool, call, args, kwargs,
                  restrictable: bool = True):
  """An attention layer (linen ``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``:
  ``call(inputs_q, inputs_k=None, inputs_v=None, **kw)``) inside an SBP site: ``(y,)`` where
  jmem computes it, None where it runs as it is.

  Recording, an attention over the node axis marks the site as mixing its nodes. Replaying
  in rows mode, it computes the kept queries only, against the keys and values of every
  node; the dropped rows are 0 (their cotangent is 0: nothing flows back through them).
  """
  q = args[0] if args else kwargs.get("inputs_q")
  if not tape.attends_over_nodes(q.shape):
    if not tape.attends_within_nodes(q.shape) and tape.mode == "record":
      # It mixes the nodes in another layout (the tokens of several frames): rows mode,
      # re-run in full with the dropped rows' cotangent at zero.
      tape.mixing = tape.mixing or f"the attention at {path!r}"
    return None
  if dropout_on:
    raise ValueError(
        f"jmem.SBP: the attention at {path!r} attends over the SBP node axis with dropout on; "
        "the backward's re-run computes the kept queries only and would draw other dropout "
        "masks. Set its dropout rate to 0 or make it deterministic.")
  if tape.mode == "record":
    tape.mixing = tape.mixing or f"the attention at {path!r}"
    return None
  if tape.rows is None or not restrictable:
    return None                           # re-run in full (the cotangent does the rest)
  kw = dict(zip(("inputs_q", "inputs_k", "inputs_v"), args[:3]), **kwargs)
  if kw.get("inputs_kv") is not None:
    kw["inputs_k"] = kw["inputs_v"] = kw["inputs_kv"]
  kw.pop("inputs_kv", None)
  full_q = kw["inputs_q"]
  if kw.get("inputs_k") is None:
    kw["inputs_k"] = full_q
  if kw.get("inputs_v") is None:
    kw["inputs_v"] = kw["inputs_k"]
  axis = full_q.ndim - 2
  kw["inputs_q"] = jnp.take(full_q, tape.rows, axis=axis)
  mask = kw.get("mask")
  if mask is not None and mask.shape[-2] > 1:
    kw["mask"] = jnp.take(mask, tape.rows, axis=mask.ndim - 2)
  rows = call(**kw)
  full = jnp.zeros(full_q.shape[:-1] + rows.shape[-1:], rows.dtype)
  return (full.at[(slice(None),) * axis + (tape.rows,)].set(rows),)


def sbp_key(path: str, args):
  """The keep key of an SBP site from `rngs` (None without one): the same for every site."""
  return context_key("sbp", path, args, fold="")


_KIND_NAMES = {"remat": "recomputation", "sbp": "SBP", "block": "compression",
               "conv": "compression", "norm": "compression", "policy": "a memory policy"}


def stacking_note(kind: str, other: str) -> str:
  """What stacking two block techniques on one site (or nesting them) amounts to."""
  if kind == other:
    return f"Applying {_KIND_NAMES[kind]} twice to one site"
  if {kind, other} <= {"block", "conv", "norm"}:
    return "Compressing one site by two ActNN techniques"
  return (f"Stacking {_KIND_NAMES[kind]} and {_KIND_NAMES[other]} on one site, or one inside "
          "the other,")


def check_sbp_where(techniques) -> None:
  for t in techniques:
    if isinstance(t, SBP) and t.where is None:
      raise ValueError("jmem.SBP needs where= naming the per-node module (the per-frame CNN, the "
                       "token block; a class or a path regex): SBP has no default site. "
                       "E.g. jmem.SBP(keep_ratio=0.25, axis=1, where=FrameEncoder).")


def site_bits(level, kind: str, path: str) -> int:
  """Bits of an ActNN site: a block's (per-path, as calibrated), a convolution's, a norm's."""
  return {"block": dict(level.layer_bits).get(path, level.block_bits), "conv": level.conv_bits,
          "norm": level.norm_bits}[kind]


def split_arrays(args, kwargs):
  """``(arrays, rebuild)``: the array leaves of ``(args, kwargs)`` (positional or keyword, at
  any depth), and ``rebuild(arrays) -> (args, kwargs)`` with everything else (``train=True``)
  as it was: what goes through a transform, and what is closed over."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

  def rebuild(arrays):
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if k else leaf
                                        for leaf, k in zip(leaves, is_array)])
  return [leaf for leaf, k in zip(leaves, is_array) if k], rebuild


def bn_axis(technique, sync, module):
  """``(axis_name, axis_index_groups)`` of a BatchNorm site, hashable: the technique's, else
  (for InPlace-ABN stacked with SyncBN) the SyncBN's, else the module's own."""
  name, groups = technique.axis_name, technique.axis_index_groups
  if name is None and sync is not None:
    name = sync.axis_name
  if groups is None and sync is not None:
    groups = sync.axis_index_groups
  if name is None:
    name = getattr(module, "axis_name", None)
  if groups is None:
    groups = getattr(module, "axis_index_groups", None)
  if isinstance(name, list):
    name = tuple(name)
  if groups is not None:
    groups = tuple(tuple(int(j) for j in g) for g in groups)
  return name, groups


def unbound_axis_error(error: NameError, path: str) -> NameError:
  """The NameError of an unbound axis name, saying what the execution model requires."""
  return NameError(
      f"{error} (BatchNorm site {path!r}). Synchronised statistics are per-device code: run "
      "the step under jax.shard_map with this axis in the mesh. Under plain jit over sharded "
      "arrays, leave SyncBN out: XLA already computes BatchNorm statistics over the whole "
      "global batch.")


class NothingMatched(ValueError):
  """A technique's ``where=`` (or its default sites) matched nothing in the model."""


def check_all_matched(techniques, hits, seen_paths, what: str) -> None:
  """Raises for a technique that took no site (it would do nothing): ActNN L0 excepted."""
  for i, t in enumerate(techniques):
    if hits.get(i) or (isinstance(t, ActNN) and t.resolved_level().name == "L0"):
      continue
    paths = (f"Module paths: {', '.join(p or '<top>' for p in seen_paths[:12])}"
             f"{' ...' if len(seen_paths) > 12 else ''}")
    if t.where is None and type(t).__name__ in ("SyncBN", "InPlaceABN"):
      raise NothingMatched(
          f"{type(t).__name__}: there is no BatchNorm in this model (flax.linen.BatchNorm, "
          f"nnx.BatchNorm or a subclass), so it would do nothing. {paths}. A BatchNorm-like "
          "module of your own: name it in where= (its class or path).")
    where = "where=" + repr(t.where) if t.where is not None else "its default sites"
    raise NothingMatched(
        f"{type(t).__name__}: {where} matched no {what} of this model, so it would do nothing. "
        f"Module paths: {', '.join(p or '<top>' for p in seen_paths[:12])}"
        f"{' ...' if len(seen_paths) > 12 else ''}. Give where= a module class or a regular "
        "expression over these paths.")


class CoverageWarning(UserWarning):
  """A technique took fewer of the model's layers than it looks like it would: what it left
  out, why, and how to include it (`check_coverage`)."""


_CONTAINERS = (nn.Sequential, nnx.Sequential)


def is_single_layer(cls) -> bool:
  """A layer of Flax's own (``nn.Conv``, ``nnx.BatchNorm``, ...), not a block of several."""
  return cls.__module__.startswith("flax.") and not issubclass(cls, _CONTAINERS)


def conv_like(kernel) -> bool:
  """A parameter shaped like a 2-D convolution's kernel (``[kh, kw, in, out]``)."""
  return getattr(kernel, "ndim", 0) == 4


def check_coverage(techniques, hits, layers, model_name: str) -> None:
  """Warns (`CoverageWarning`, once per technique and model class) where a technique's
  sites leave most of what it is for out, saying what, why and how to include it.

  ``layers``: ``{path: (class, owns a 4-D kernel)}`` of every module call (linen) or
  module (NNX). Two cases: `Remat` (or a recomputing `Policy`) on its default sites where
  those are all single Flax layers (a flat model: recomputing one layer saves next to
  nothing, its input being saved anyway as the previous layer's output); `Spatial` where
  modules with a convolution kernel are not its sites (a module computing its own
  convolution with ``lax.conv_general_dilated``, which it cannot see).
  """
  from jmem.ops.policy import Policy  # pylint: disable=g-import-not-at-top
  from jmem.ops.remat import Remat  # pylint: disable=g-import-not-at-top
  from jmem.parallel.spatial.technique import Spatial  # pylint: disable=g-import-not-at-top
  for i, t in enumerate(techniques):
    taken = list(dict.fromkeys(hits.get(i) or ()))
    name = type(t).__name__
    recomputes = isinstance(t, Remat) or (isinstance(t, Policy) and
                                          t.kind in ("recompute", "recompute_compressed"))
    if recomputes and t.where is None and taken and all(
        p in layers and is_single_layer(layers[p][0]) for p in taken):
      shown = ", ".join(f"{p} ({layers[p][0].__name__})" for p in taken[:5])
      warn_once(f"coverage-{name}-{model_name}", (
          f"jmem.{name} on {model_name}: its default sites, the top module's direct "
          f"children, are single layers here ({len(taken)}: {shown}"
          f"{', ...' if len(taken) > 5 else ''}), and recomputing one layer saves next to "
          "nothing (its input is saved anyway, as the previous layer's output). "
          "Recomputation needs blocks, modules holding several layers (nn.Sequential / "
          "nnx.Sequential, or modules of your own): build the model from them, or name "
          "deeper ones in where= (a class, or a regular expression over module paths)."),
          CoverageWarning)
    if isinstance(t, Spatial) and t.where is None:
      convs = [p for p, (_, k) in layers.items() if k]
      left = [p for p in convs if p not in taken]
      if left:
        shown = ", ".join(f"{p} ({layers[p][0].__name__})" for p in left[:5])
        warn_once(f"coverage-{name}-{model_name}", (
            f"jmem.Spatial on {model_name} took {len(set(convs) - set(left))} of the "
            f"{len(convs)} modules with a convolution kernel; not {len(left)}: {shown}"
            f"{', ...' if len(left) > 5 else ''}. "
            "Spatial shards the 2-D convolutions of flax.linen.Conv / nnx.Conv calls only; "
            "these are other modules (a module of your own computing its convolution, e.g. "
            "with lax.conv_general_dilated, or a transposed convolution), which it leaves: "
            "XLA partitions those as it can (jmem.collective_counts of the compiled step "
            "shows the collectives). To include one, build it from nn.Conv / nnx.Conv (a "
            "depthwise convolution is Conv(C, kernel, feature_group_count=C)); where= says "
            "which convolutions you mean and silences this."), CoverageWarning)


def is_head(module) -> bool:
  return isinstance(module, (nn.Dense, nnx.Linear))


def describe(module) -> str:
  t = type(module)
  return f"{t.__module__}.{t.__qualname__}"

