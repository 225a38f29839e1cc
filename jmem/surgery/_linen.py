"""`jmem.convert` for linen: a wrapper that shares the model's scope and intercepts its
module calls (``nn.intercept_methods``).

Sites are module calls. A block site (`Remat`, `ActNN`) runs the module's ``__call__``
under a lifted transform (``lift.pack``: the variables and RNGs go through the transform
as arguments, so ``batch_stats`` updates flow out and no tracer leaks); a BatchNorm site
(`SyncBN`, `InPlaceABN`) computes with the module's own fields and variables. Variable
paths never change: the wrapper uses the model's scope (``nn.share_scope``).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses

import flax.core.lift as lift
import flax.linen as nn
import numpy as np
from flax.core.scope import Scope
from flax.linen.module import TestScope
from flax.linen import transforms as nn_transforms

from jmem import _bn_core as bn_core
from jmem.ops.actnn import between
from jmem.ops.actnn.technique import ActNN
from jmem.ops.inplace_abn import core as abn_lib
from jmem.ops.inplace_abn.technique import InPlaceABN
from jmem.ops.policy import Policy
from jmem.ops.remat import Remat
from jmem.ops.sbp import sites as sbp_sites
from jmem.ops.sbp.technique import SBP
from jmem.parallel.spatial import sharded as spatial_sharded
from jmem.parallel.spatial.modules import HaloConv
from jmem.parallel.spatial.technique import Spatial
from jmem.parallel.sync_bn import core as sync_bn
from jmem.parallel.sync_bn.technique import SyncBN
from jmem.surgery import _common as c


RECORD: contextvars.ContextVar = contextvars.ContextVar("jmem_site_record", default=None)


def _lift(transform):
  """A lifted transform from ``transform(pure) -> g``, ``g(variable_groups, rng_groups,
  *arrays)``: array arguments (positional or keyword, at any depth) go through ``g``,
  everything else (``train=True``) is closed over."""

  def lifted(fn):
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
      arrays, rebuild = c.split_arrays(args, kwargs)
      start = {}

      def pure(variable_groups, rng_groups, *arrays):
        a, kw = rebuild(arrays)
        scope = scope_fn(variable_groups, rng_groups)
        # The RNG counters are the outer scope's (flax shares them), and ``pure`` can be
        # traced more than once (a custom VJP's forward again, after its primal: a site
        # inside `between.compact_between_sites`' jaxpr). Every trace draws from where the
        # first began, and leaves the counters as it found them: the keys stay those of
        # the plain model.
        counters = list({id(x.rng_counters): x.rng_counters for x in _scopes(scope)}.values())
        if not start:
          start["counters"] = copy.deepcopy(counters)
          y = fn(scope, *a, **kw)
        else:
          now = copy.deepcopy(counters)
          for c_, v in zip(counters, start["counters"]):
            _set_counters(c_, v)
          try:
            y = fn(scope, *a, **kw)
          finally:
            for c_, v in zip(counters, now):
              _set_counters(c_, v)
        return y, repack_fn(scope)
      return transform(pure)(variable_groups, rng_groups, *arrays)

    return lift.pack(inner, (True,), (True,), (True,), name="jmem", enable_kwargs=True)
  return lifted


def _scopes(tree):
  """The scopes of a lifted transform's scope tree (a scope, or lists/tuples of them)."""
  if isinstance(tree, (list, tuple)):
    for t in tree:
      yield from _scopes(t)
  elif tree is not None:
    yield tree


def _set_counters(counters: dict, values: dict) -> None:
  """flax's (nested) RNG counters set in place to ``values``: the dicts child scopes hold
  stay the same objects; entries made since are dropped."""
  for k in [k for k in counters if k not in values]:
    del counters[k]
  for k, v in values.items():
    if isinstance(v, dict) and isinstance(counters.get(k), dict):
      _set_counters(counters[k], v)
    else:
      counters[k] = copy.deepcopy(v)


def _path(module, root: tuple) -> str:
  """``module``'s path under the converted model, as its variables are laid out. A
  submodule held in a dataclass field of the top model (``nn.Sequential([Block(),
  Block()])``, a zoo's ``blocks: Sequence[Module]``) has a scope path under the wrapper's
  attribute (``model/layers_0``) while its variables sit at ``layers_0``: the path is taken
  along the parents up to the model's scope."""
  names, m = [], module
  while isinstance(m, nn.Module) and m.scope is not None:
    if tuple(m.scope.path) == root:
      return "/".join(reversed(names))
    names.append(m.name)
    m = m.parent
  path = tuple(module.scope.path)         # a lifted transform's copy: its scope's path
  return "/".join(path[len(root):])


def _detached_root(module, trace) -> bool:
  """``module`` was bound by its own ``init``/``apply`` inside the converted model's call
  (``Block(parent=None).apply(...)`` in a ``__call__``): its variables are not the model's,
  and the paths under it start again from its own root. A lifted transform's copy of a
  module has a scope for parent too, but keeps its path in the model, and a lifted copy of
  the top model (``jmem.convert(nn.remat(Net)(), ...)``, or jmem's own for a site at
  ``<top>``) keeps the top model's name and class (a root that ``apply`` binds keeps the
  name it was given, if any)."""
  if (not isinstance(module.parent, Scope) or isinstance(module.parent, TestScope)
      or module.scope.path or id(module) in trace.in_site):
    return False          # (flax checks a setup() abstractly under a TestScope root: not ours)
  # A lifted class subclasses the one it lifts: nn.remat(Net)'s copy is a Net.
  return not (module.name == trace.top.name and isinstance(trace.top, type(module)))


@dataclasses.dataclass
class _Trace:
  """The state of one trace of a converted model (init or apply)."""

  techniques: tuple
  root: tuple
  hits: dict = dataclasses.field(default_factory=dict)       # technique index -> paths
  in_site: set = dataclasses.field(default_factory=set)      # ids of modules under a transform
  active: list = dataclasses.field(default_factory=list)     # (found, spec, path) enclosing
  pairs: dict = dataclasses.field(default_factory=dict)      # id(bn) -> activation pair
  sbp_keys: dict = dataclasses.field(default_factory=dict)   # technique index -> keep key
  top: nn.Module | None = None                               # the converted model
  seen: list = dataclasses.field(default_factory=list)       # paths of the calls, in order
  calls: list = dataclasses.field(default_factory=list)      # paths of the calls running
  roots: list = dataclasses.field(default_factory=list)      # (path, id) of detached roots
  covering: list = dataclasses.field(default_factory=list)   # block sites the call is in
  layers: dict = dataclasses.field(default_factory=dict)     # path -> (class, conv kernel)

  # ------------------------------------------------------------------ classification
  def _bn_techniques(self):
    return [(i, t) for i, t in enumerate(self.techniques) if isinstance(t, (SyncBN, InPlaceABN))]

  def bn_site(self, mod, path):
    """``[(index, technique)]`` of the BN techniques that take this module (raises for one
    they cannot handle)."""
    status = c.linen_bn_status(mod)
    found = []
    for i, t in self._bn_techniques():
      if t.where is None:
        if status == "bn":
          found.append((i, t))
        elif status == "override":
          raise ValueError(
              f"{type(t).__name__}: {c.describe(mod)} at {path or '<top>'!r} is a BatchNorm "
              "subclass with its own __call__, so jmem cannot know what it computes. Name it "
              f"in where= (its class or path) to have its call replaced by {type(t).__name__}'s "
              "computation with its fields and variables, or leave it out with a where= that "
              "does not match it.")
      elif t.matches_user(mod, path) and (
          status is not None or all(hasattr(mod, f) for f in c.LINEN_BN_FIELDS) or
          type(mod) in t.where_items):
        # where= filters BatchNorm-like modules (the others it matches are not its business)
        if status != "bn" and not t.names(type(mod), path):
          raise ValueError(
              f"{type(t).__name__}: where= matches {c.describe(mod)} at {path or '<top>'!r} "
              "only through a base class, and it overrides BatchNorm's __call__; name its "
              "own class or path in where= to have it replaced.")
        missing = [f for f in c.LINEN_BN_FIELDS
                   if not hasattr(mod, f) and f not in bn_core.LINEN_BN_OPTIONAL]
        if missing:
          raise ValueError(
              f"{type(t).__name__}: {c.describe(mod)} at {path or '<top>'!r} lacks BatchNorm's "
              f"fields {missing} (of flax.linen.BatchNorm's, only "
              f"{sorted(bn_core.LINEN_BN_OPTIONAL)} may be left out: their defaults stand in); "
              "jmem replaces a BatchNorm-like module's call using those fields and "
              "flax.linen.BatchNorm's variable names (batch_stats mean/var, params "
              "scale/bias). Add the fields to the class, or replace it by nn.BatchNorm.")
        found.append((i, t))
    if len(found) > 1:
      kinds = {type(t) for _, t in found}
      if kinds != {SyncBN, InPlaceABN} or len(found) > 2:
        raise ValueError(f"Several BatchNorm techniques take the module at {path!r}: "
                         f"{[t for _, t in found]}; give them disjoint where=.")
    return found

  def block_site(self, mod, path):
    """The block techniques taking this call: ``[(index, technique, kind)]`` (empty: not a
    block site)."""
    found = []
    for i, t in enumerate(self.techniques):
      if isinstance(t, (Remat, Policy)):
        if self._block_match(t, mod, path):
          found.append((i, t, "remat" if isinstance(t, Remat) else "policy"))
      elif isinstance(t, SBP):
        if t.matches_user(mod, path):
          found.append((i, t, "sbp"))
      elif isinstance(t, ActNN):
        lv = t.resolved_level()
        if lv.block_bits is not None and self._block_match(t, mod, path):
          found.append((i, t, "block"))
        elif t.where is None and lv.conv_bits is not None and isinstance(mod, nn.Conv):
          found.append((i, t, "conv"))
        elif t.where is None and lv.norm_bits is not None and c.linen_bn_status(mod) == "bn":
          found.append((i, t, "norm"))
        elif (t.where is not None and lv.block_bits is None and
              (lv.conv_bits is not None or lv.norm_bits is not None) and
              t.matches_user(mod, path)):
          found.append((i, t, "conv" if lv.norm_bits is None or
                        c.linen_bn_status(mod) is None else "norm"))
    c.check_sbp_alone(found, path)
    return found

  def spatial_site(self, mod, path):
    """``(index, technique)`` of the `Spatial` technique taking this convolution."""
    for i, t in enumerate(self.techniques):
      if not isinstance(t, Spatial):
        continue
      conv = isinstance(mod, HaloConv) or (
          isinstance(mod, nn.Conv) and len(tuple(np.atleast_1d(mod.kernel_size))) == 2)
      if conv and (t.where is None or t.matches_user(mod, path)):
        return i, t
      if t.where is not None and t.names(type(mod), path) and not conv:
        raise ValueError(f"Spatial: where= names {c.describe(mod)} at {path or '<top>'!r}, "
                         "which is not a 2-D convolution (nn.Conv, HaloConv); a path regex "
                         "over a block selects the convolutions inside it.")
    return None

  def _call_spatial(self, mod, path, site, next_fun, args, kwargs):
    index, t = site
    self._hit(index, path)
    if mod.is_initializing():
      return next_fun(*args, **kwargs)
    if getattr(mod, "conv_general_dilated", None) is not None or \
        getattr(mod, "conv_general_dilated_cls", None) is not None:
      raise ValueError(f"Spatial: the convolution at {path!r} already has its own "
                       "conv_general_dilated; jmem.Spatial replaces that function. Leave this "
                       "module out with where=.")
    # The module computes as it always does (parameters, masks, dtype promotion), its
    # convolution primitive swapped for the sharded one for this call only.
    object.__setattr__(mod, "conv_general_dilated",
                       spatial_sharded.sharded_conv(t.mesh, t.axes, t.data_axis, where=path))
    try:
      return next_fun(*args, **kwargs)
    finally:
      object.__setattr__(mod, "conv_general_dilated", None)

  def _block_match(self, t, mod, path):
    if t.where is None:
      return path != "" and "/" not in path and not c.is_head(mod)
    return t.matches_user(mod, path)

  # ------------------------------------------------------------------ interception
  def intercept(self, next_fun, args, kwargs, context):
    mod = context.module
    if mod.scope is None:
      return next_fun(*args, **kwargs)
    if self.roots or _detached_root(mod, self):
      return self._call_detached(mod, context.method_name, next_fun, args, kwargs)
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    path = _path(mod, self.root)
    if id(mod) not in self.in_site:
      found = self.block_site(mod, path)
      site = c.nested_site(found, path, self.active) if found else None
      # Techniques that an enclosing site of theirs covers here (as NNX).
      self._hit_all([f for f in found if site is None or f not in site[0]], path,
                    record=False)
      if site is not None:
        self.covering.append(path)
        try:
          if not mod.is_initializing():
            return self._call_block(mod, path, *site, args, kwargs)
          self._hit_all(site[0], path, record=False)   # init: the forward pass, nothing to save
          return self._layer(mod, path, next_fun, args, kwargs)
        finally:
          self.covering.pop()
    return self._layer(mod, path, next_fun, args, kwargs)

  def detached_path(self, mod, root: bool) -> str:
    """The path jmem gives a call outside the model's variables: ``<detached Class>`` where
    its root is applied (after the path of the call that applies it), then the path inside
    it. A where= regex naming the model's modules does not match it (a broad one, ``.*``,
    does), a class in where= does. ``root``: `_new_root`."""
    if root:
      base = self.calls[-1] if self.calls else ""
      return (base + "/" if base else "") + f"<detached {type(mod).__name__}>"
    return "/".join([self.roots[-1][0], *mod.scope.path])

  def _new_root(self, mod) -> bool:
    """A detached root not already running (its own methods calling each other)."""
    return _detached_root(mod, self) and not (self.roots and self.roots[-1][1] == id(mod))

  def _call_detached(self, mod, method, next_fun, args, kwargs):
    """A module call outside the model's variables (`_detached_root`, or under one). Its
    layers are no block sites (Remat, ActNN, Policy, SBP: their sites are the model's
    blocks), with a warning (none inside a block site: its transform covers them);
    BatchNorm and Spatial techniques take its BatchNorms and
    convolutions as anywhere else (where=None or a class), at its `detached_path`."""
    root = self._new_root(mod)
    path = self.detached_path(mod, root)
    # Inside a block site the module runs under the site's transform (recomputed or
    # compressed with the rest of the block): nothing to warn about.
    if root and not self.covering and any(
        not isinstance(t, (SyncBN, InPlaceABN, Spatial)) for t in self.techniques):
      what = c.describe(mod)
      fix = ("Make it a submodule (self.block = Block(...) in setup, or Block(name=...)(x)) "
             "for jmem.convert to reach it.")
      c.warn_once(f"detached-{what}", (
          f"jmem.convert: {what} is applied detached inside the model's call "
          "(Module(parent=None).apply, its variables held by the caller; jmem calls it "
          f"{path!r}), so its layers are no sites of block techniques (Remat, ActNN, Policy, "
          f"SBP) and run as they are. {fix}"))
    if root:
      self.roots.append((path, id(mod)))
    self.calls.append(path)
    try:
      if method != "__call__":
        return next_fun(*args, **kwargs)
      if path not in self.seen:
        self.seen.append(path)
      return self._layer(mod, path, next_fun, args, kwargs)
    finally:
      self.calls.pop()
      if root:
        self.roots.pop()

  def _layer(self, mod, path, next_fun, args, kwargs):
    """A call that is no block site (or whose site is running): a Sequential with
    InPlace-ABN pairs, a Spatial convolution, a BatchNorm site, a layer of an SBP site, or
    the module as it is (a BatchNorm-like module there is checked)."""
    if isinstance(mod, nn.Sequential) and any(isinstance(t, InPlaceABN) for t in self.techniques):
      return self._call_sequential(mod, args, kwargs)
    spatial = self.spatial_site(mod, path)
    if spatial is not None:
      return self._call_spatial(mod, path, spatial, next_fun, args, kwargs)
    bn = self.bn_site(mod, path)
    if bn:
      return self._call_bn(mod, path, bn, args, kwargs)
    tape = sbp_sites.active_tape()
    if tape is not None:
      handled = self._in_sbp_site(tape, mod, path, next_fun, args, kwargs)
      if handled is not None:
        return handled[0]
    y = next_fun(*args, **kwargs)
    if (self._bn_techniques() or c.active_mask() is not None) and c.linen_has_bn_variables(mod):
      self._unhandled_bn(mod, path)
    return y

  def _unhandled_bn(self, mod, path):
    if c.active_mask() is not None and not getattr(mod, "_jmem_reads_batch_mask", False):
      raise ValueError(
          f"jmem.batch_mask is active but the BatchNorm-like module at {path or '<top>'!r} is "
          "not a jmem site, so it would ignore the mask: include it in a jmem.SyncBN() "
          "(axis_name=None for local statistics) or jmem.InPlaceABN() where=.")
    named = [t for _, t in self._bn_techniques() if t.where is not None and
             t.matches_user(mod, path)]
    if named:
      raise ValueError(
          f"{type(named[0]).__name__}: where= matches {c.describe(mod)} at {path or '<top>'!r}, "
          "which keeps BatchNorm statistics (batch_stats mean/var) but lacks "
          f"flax.linen.BatchNorm's fields {[f for f in c.LINEN_BN_FIELDS if not hasattr(mod, f)]}"
          ", so jmem cannot replace its call; give it BatchNorm's fields or replace it by "
          "nn.BatchNorm.")
    defaults = [t for _, t in self._bn_techniques() if t.where is None]
    if defaults:
      raise ValueError(
          f"{type(defaults[0]).__name__}: {c.describe(mod)} at {path or '<top>'!r} keeps "
          "BatchNorm statistics (batch_stats mean/var) but is not a flax.linen.BatchNorm, so "
          "jmem does not know its computation. Name it in where= (its class or path) if it "
          "has BatchNorm's fields and computes BatchNorm, or replace it by nn.BatchNorm.")

  def _in_sbp_site(self, tape, mod, path, next_fun, args, kwargs):
    """A layer inside an SBP site that couples nodes or draws randomness: ``(y,)`` where
    jmem computes it, None where it runs as it is."""
    status = c.linen_bn_status(mod)
    if status == "bn":
      return (self._call_bn(mod, path, [], args, kwargs),)
    if status is not None or c.linen_has_bn_variables(mod):
      raise ValueError(
          f"jmem.SBP: {c.describe(mod)} at {path!r} keeps BatchNorm statistics inside an SBP "
          "site, where jmem computes BatchNorm itself (all-node statistics, held constant in "
          "the backward), but it is not a flax.linen.BatchNorm (or overrides its __call__), "
          "so jmem does not know its computation. Replace it by nn.BatchNorm (or a per-sample "
          "norm such as nn.GroupNorm), or name it in jmem.SyncBN(axis_name=None, where=...) if "
          "it computes BatchNorm.")
    if isinstance(mod, nn.MultiHeadDotProductAttention):
      return self._sbp_attention(tape, mod, path, next_fun, args, kwargs)
    if isinstance(mod, nn.Dropout) and tape.mode == "record":
      deterministic = nn.merge_param("deterministic", mod.deterministic,
                                     kwargs.get("deterministic", args[1] if len(args) > 1
                                                else None))
      if mod.rate > 0 and not deterministic:
        tape.dropout = f"the Dropout at {path!r}"
    return None

  def _sbp_attention(self, tape, mod, path, next_fun, args, kwargs):
    deterministic = kwargs.get("deterministic", mod.deterministic)
    # nn.SelfAttention takes no separate keys and values: re-run in full.
    return c.sbp_attention(tape, path, mod.dropout_rate > 0 and not deterministic, next_fun,
                           args, kwargs, restrictable=not isinstance(mod, nn.SelfAttention))

  def _hit(self, index, path, record=True):
    self.hits.setdefault(index, []).append(path)
    record = RECORD.get() if record else None
    if record is not None:
      record.setdefault(index, []).append(path)

  def _hit_all(self, found, path, record=True):
    for index, _, _ in found:
      self._hit(index, path, record)

  def _call_block(self, mod, path, found, spec, args, kwargs):
    self._hit_all(found, path)
    if spec is None:
      index, t, _ = found[0]
      # One draw per step for all the sites of a technique: blocks over the same tokens keep
      # the same ones (the SBP papers' rule for transformer stages).
      if index not in self.sbp_keys:
        if mod.scope.has_rng("sbp"):
          self.sbp_keys[index] = mod.make_rng("sbp")
        else:
          self.sbp_keys[index] = c.sbp_key(path, (args, kwargs))
      transform = c.sbp_transform(t, self.sbp_keys[index], path,
                                  c.streams_of(self.techniques))
    else:
      key = missing = None
      probe = c.probe_of(found)
      if c.needs_key(probe, spec):
        if mod.scope.has_rng("actnn"):
          key = mod.make_rng("actnn")
        else:
          key = c.context_key("actnn", path, (args, kwargs, mod.variables))
          if key is None:     # raises if differentiated (a forward pass needs no key)
            missing = c.missing_actnn_key(path, c.streams_of(self.techniques))
      transform = c.block_transform(probe, spec, key, path, missing)

    def fn(cloned, *a, **kw):
      self.in_site.add(id(cloned))
      self.active.append((found, spec, path))
      try:
        return cloned(*a, **kw)
      finally:
        self.active.pop()
        self.in_site.discard(id(cloned))

    return nn_transforms.lift_transform(_lift(transform), fn)(mod, *args, **kwargs)

  def _call_sequential(self, seq, args, kwargs):
    layers = list(seq.layers)
    if not layers:
      raise ValueError(f"Empty Sequential module {seq.name}.")
    skip = set()
    for i in range(len(layers) - 1):
      if isinstance(layers[i], nn.Module) and isinstance(layers[i], nn.BatchNorm):
        pair = c.activation_of(layers[i + 1])
        if pair is not None:
          self.pairs[id(layers[i])] = pair
          if pair[0] != "other":
            skip.add(i + 1)
    outputs = layers[0](*args, **kwargs)
    for i, layer in enumerate(layers[1:], start=1):
      if i in skip and self.pairs.pop(("done", id(layers[i - 1])), False):
        continue
      if isinstance(outputs, tuple):
        outputs = layer(*outputs)
      elif isinstance(outputs, dict):
        outputs = layer(**outputs)
      else:
        outputs = layer(outputs)
    return outputs

  def _call_bn(self, mod, path, found, args, kwargs):
    x, *rest = args
    use_ra = rest[0] if rest else kwargs.get("use_running_average")
    mask = kwargs.get("mask")
    if mask is None:
      mask = c.mask_for(x, c.active_mask(), path)
    kinds = {type(t): (i, t) for i, t in found}
    initializing = mod.is_initializing()
    if not found:                          # a plain BatchNorm inside an SBP site
      train_fn = sync_bn._sync_train_fn(  # pylint: disable=protected-access
          None if initializing else mod.axis_name, mod.axis_index_groups, mod.epsilon)
      eval_fn = sync_bn._bn_eval_fn(mod.epsilon)  # pylint: disable=protected-access
      unbiased = False
    elif InPlaceABN in kinds:
      t = kinds[InPlaceABN][1]
      pair = self.pairs.get(id(mod))
      name, groups = c.bn_axis(t, kinds.get(SyncBN, (None, None))[1], mod)
      if not (mod.use_scale and mod.use_bias):
        raise ValueError(f"InPlaceABN: the BatchNorm at {path!r} has use_scale/use_bias False; "
                         "InPlace-ABN inverts its affine step and needs both.")
      cfg = c.abn_config(t, pair, path, mod.epsilon, None if initializing else name, groups)
      train_fn, eval_fn = abn_lib._abn_fns(cfg, t.implementation)  # pylint: disable=protected-access
      unbiased = t.unbiased_running_var
      for j, _ in found:
        self._hit(j, path)
      if pair is not None:
        self.pairs[("done", id(mod))] = True
    else:
      i, t = found[0]
      name, groups = c.bn_axis(t, None, mod)
      train_fn = sync_bn._sync_train_fn(None if initializing else name, groups, mod.epsilon,  # pylint: disable=protected-access
                                        t.implementation)
      eval_fn = sync_bn._bn_eval_fn(mod.epsilon)  # pylint: disable=protected-access
      unbiased = t.unbiased_running_var
      self._hit(i, path)
    train_fn = sbp_sites.taped_train_fn(train_fn, eval_fn)
    try:
      return sync_bn.linen_norm_call(mod, x, use_ra, mask, train_fn=train_fn, eval_fn=eval_fn,
                                     use_scale=mod.use_scale, use_bias=mod.use_bias,
                                     unbiased_running_var=unbiased)
    except NameError as e:
      raise c.unbound_axis_error(e, path) from None


class Converted(nn.Module):
  """A linen model with `jmem.convert` techniques: same variables, same ``init``/``apply``.

  ``model`` is the original (unconverted) module, ``techniques`` what was applied.
  """

  model: nn.Module
  techniques: tuple

  # Its sites read an active jmem.batch_mask, and its other BatchNorm-like modules refuse
  # one (`_unhandled_bn`): `jmem.train` adds no guard of its own.
  _jmem_guards_batch_mask = True

  def setup(self):
    nn.share_scope(self, self.model)

  def __call__(self, *args, **kwargs):
    return self._run(lambda model, *a, **kw: model(*a, **kw), args, kwargs)

  def _method(self, method, *args, **kwargs):
    if isinstance(method, str):
      return self._run(lambda model, *a, **kw: getattr(model, method)(*a, **kw), args, kwargs)
    return self._run(method, args, kwargs)

  def apply(self, variables, *args, method=None, **kwargs):  # pylint: disable=arguments-differ
    """``Module.apply``; ``method`` (a name, or a function of the ORIGINAL model's class such
    as ``Net.encode``) runs on the original model with the techniques on."""
    if method is None or method == "__call__":
      return super().apply(variables, *args, **kwargs)
    return super().apply(variables, *args, method=_MethodOf(method), **kwargs)

  def init(self, rngs, *args, method=None, **kwargs):  # pylint: disable=arguments-differ
    if method is None or method == "__call__":
      return super().init(rngs, *args, **kwargs)
    return super().init(rngs, *args, method=_MethodOf(method), **kwargs)

  def _run(self, call, args, kwargs):
    """``call(model, *args, **kwargs)`` with the sites on: the model's module calls are
    intercepted; with a technique that `compacts_between_sites`, the whole call goes through
    `between.compact_between_sites` (as a lifted transform, so variables and RNGs pass
    through it as arguments)."""
    trace = _Trace(self.techniques, tuple(self.scope.path), top=self.model)

    def record(next_fun, a, kw, context):
      mod = context.module
      if (context.method_name != "__call__" or mod.scope is None or trace.roots
          or _detached_root(mod, trace)):
        return next_fun(*a, **kw)                  # detached calls: `_Trace._call_detached`
      p = _path(mod, trace.root)
      if p not in trace.seen:
        trace.seen.append(p)
      trace.calls.append(p)
      try:
        return next_fun(*a, **kw)
      finally:
        trace.calls.pop()
        if p not in trace.layers:
          trace.layers[p] = (type(mod), c.conv_like(_own_kernel(mod)))

    if any(t.compacts_between_sites for t in self.techniques):
      call = nn_transforms.lift_transform(_lift(between.compact_between_sites), call)
    with nn.intercept_methods(record), nn.intercept_methods(trace.intercept):
      y = call(self.model, *args, **kwargs)
    c.check_all_matched(self.techniques, trace.hits, trace.seen, "module call")
    c.check_coverage(self.techniques, trace.hits, trace.layers, type(self.model).__name__)
    return y


def _own_kernel(mod: nn.Module):
  """The module's own ``kernel`` parameter (None where it has none)."""
  try:
    return mod.get_variable("params", "kernel")
  except Exception:  # pylint: disable=broad-except  (an unbound or detached scope)
    return None


class _MethodOf:
  """``apply(method=...)`` of a converted model: the original model's method, by name or
  function, run through `Converted._method`."""

  def __init__(self, method):
    self.method = method
    self.__name__ = getattr(method, "__name__", str(method))

  def __call__(self, converted, *args, **kwargs):
    return converted._method(self.method, *args, **kwargs)  # pylint: disable=protected-access


def convert_linen(model: nn.Module, techniques: tuple) -> nn.Module:
  if isinstance(model, Converted):
    return Converted(model.model, model.techniques + techniques)
  if model.scope is not None:
    raise ValueError("jmem.convert takes an unbound linen module (the one whose init/apply you "
                     "call), not one bound to a parent or to variables. To convert a submodule, "
                     "convert the top model and select the submodule with where= (its class or "
                     "path).")
  return Converted(model, techniques)
