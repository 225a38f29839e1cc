"""`jmem.convert` for NNX: the model is changed in place by giving each site module a
subclass of its own class (same name, same attributes, so ``nnx.state`` paths do not change)
whose ``__call__`` applies the technique around, or instead of, the original one."""

from __future__ import annotations

import functools

import jax
from flax import nnx
from flax.nnx import graphlib
from jax import lax

from jmem.ops.actnn import between
from jmem.ops.inplace_abn import core as abn_lib
from jmem.ops.inplace_abn.technique import InPlaceABN
from jmem.ops.policy import Policy
from jmem.ops.remat import Remat
from jmem.ops.sbp import sites as sbp_sites
from jmem.ops.sbp.technique import SBP
from jmem.parallel.spatial import sharded as spatial_sharded
from jmem.parallel.spatial.technique import Spatial
from jmem.parallel.sync_bn import core as sync_bn
from jmem.parallel.sync_bn.technique import SyncBN
from jmem.surgery import _common as c

_CLASSES: dict = {}


def _subclass(base: type, kind: str, cfg, call, *, cache: bool = True) -> type:
  key = (base, kind, cfg)
  if key in _CLASSES:
    return _CLASSES[key]
  cls = type(base.__name__, (base,), {"__call__": call(base, cfg), "__module__":
                                      base.__module__, "__qualname__": base.__qualname__,
                                      "_jmem_site": (kind, cfg)})
  if cache:
    _CLASSES[key] = cls
  return cls


def _block_call(base, cfg):
  kind, path, opts = cfg[:3]
  probe = cfg[3] if len(cfg) > 3 else None     # a calibration probe (`_common.probe_of`)

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    def transform(arrays, state):
      if kind == "sbp":
        # One key for every site of the technique: blocks over the same tokens keep the same.
        return c.sbp_transform(opts, c.sbp_key(path, (arrays,)), path)
      key = missing = None
      if c.needs_key(probe, opts):
        key = c.context_key("actnn", path, (arrays, state))
        if key is None:       # raises if differentiated (a forward pass needs no key)
          missing = c.missing_actnn_key(path)
      return c.block_transform(probe, opts, key, path, missing)
    return _call_through(base, self, args, kwargs, transform)

  return __call__


def _call_through(base, self, args, kwargs, transform):
  """``base.__call__(self, *args, **kwargs)`` through ``transform(arrays, state)(pure)``,
  ``pure(state, keys, *arrays) -> (y, new state)``: the module's state and the array
  arguments go through the transform as arguments (non-arrays are closed over), and the
  new state is written back."""
  # Graph nodes passed to the call (``rngs=nnx.Rngs(...)``, a module) travel with the
  # module's own state, so that what the call updates in them (an RNG count) comes out as
  # the plain call's would; the arrays go through the transform one by one.
  leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=graphlib.is_graph_node)
  nodes = [leaf for leaf in leaves if graphlib.is_graph_node(leaf)]
  args, kwargs = jax.tree.unflatten(tree, [_NODE if graphlib.is_graph_node(leaf) else leaf
                                           for leaf in leaves])
  graphdef, state = nnx.split((self, nodes))
  arrays, rebuild = c.split_arrays(args, kwargs)

  # The keys of `jmem.rngs` go through the transform as an argument (never compressed): a
  # site inside this one reads them as values of the transform's trace, not as constants
  # captured from outside it.
  keys = c.current_rngs()

  def pure(state, keys, *arrays):
    module, inner = nnx.merge(graphdef, state)
    it = iter(inner)
    a, kw = jax.tree.map(lambda leaf: next(it) if leaf is _NODE else leaf, rebuild(arrays))
    if keys is None:
      y = base.__call__(module, *a, **kw)
    else:
      with c.RngStreams(keys):
        y = base.__call__(module, *a, **kw)
    return y, nnx.state((module, inner))

  y, new_state = transform(arrays, state)(pure)(state, keys, *arrays)
  nnx.update((self, nodes), new_state)
  return y


class _Node:
  """Where a graph node was in a call's arguments (`_call_through`)."""


_NODE = _Node()


def _between_call(base, cfg):
  """The top module's call through `between.compact_between_sites`."""
  del cfg

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    return _call_through(base, self, args, kwargs,
                         lambda arrays, state: between.compact_between_sites)

  return __call__


def _bn_call(base, cfg):
  kind, path, opts = cfg
  del base

  def __call__(self, x, use_running_average=None, *, mask=None):  # pylint: disable=invalid-name
    use_ra = self.use_running_average if use_running_average is None else use_running_average
    if mask is None:
      mask = c.mask_for(x, c.active_mask(), path)
    if kind == "abn":
      abn_cfg, implementation, unbiased = opts
      train_fn, eval_fn = abn_lib._abn_fns(abn_cfg, implementation)  # pylint: disable=protected-access
    else:
      axis_name, groups, unbiased, implementation = opts
      train_fn = sync_bn._sync_train_fn(axis_name, groups, self.epsilon, implementation)  # pylint: disable=protected-access
      eval_fn = sync_bn._bn_eval_fn(self.epsilon)  # pylint: disable=protected-access
    return _normalize(self, x, use_ra, mask, train_fn, eval_fn, unbiased, path)

  return __call__


def _normalize(self, x, use_ra, mask, train_fn, eval_fn, unbiased, path):
  """A BatchNorm-like module's computation on its own attributes and variables (inside an
  SBP site, on the site's tape)."""
  train_fn = sbp_sites.taped_train_fn(train_fn, eval_fn)
  scale = None if self.scale is None else self.scale[...]
  bias = None if self.bias is None else self.bias[...]
  out_dtype = sync_bn.output_dtype(getattr(self, "dtype", None), x, scale, bias)
  try:
    y, mean, var = sync_bn.normalize_with_state(
        sync_bn.promote_input(x, out_dtype), axis=self.axis, scale=scale, bias=bias, running_mean=self.mean[...],
        running_var=self.var[...], use_running_average=use_ra, mask=mask, train_fn=train_fn,
        eval_fn=eval_fn, momentum=self.momentum, unbiased_running_var=unbiased,
        op=type(self).__name__)
  except NameError as e:
    raise c.unbound_axis_error(e, path) from None
  if not use_ra:
    self.mean[...], self.var[...] = mean, var
  return y.astype(out_dtype)


def _identity(x):
  """Stands where InPlace-ABN took over an activation (the BatchNorm site applies it)."""
  return x


def bn_activation_pairs(modules) -> dict:
  """BatchNorm-like module followed by a plain function in the ``nnx.Sequential``s among
  ``modules``: ``id(bn) -> (activation_of(fn), the Sequential, fn's index)``."""
  pairs = {}
  for m in modules:
    if isinstance(m, nnx.Sequential):
      layers = list(m.layers)
      for i in range(len(layers) - 1):
        if c.nnx_bn_status(layers[i]) is not None:
          pair = c.activation_of(layers[i + 1])
          if pair is not None:
            pairs[id(layers[i])] = (pair, m, i + 1)
  return pairs


def _kernel_value(m: nnx.Module):
  """The module's own ``kernel`` array (None where it has none)."""
  k = getattr(m, "kernel", None)
  return k.get_value() if isinstance(k, nnx.Variable) else None


def convert_nnx(model: nnx.Module, techniques: tuple) -> nnx.Module:
  nodes = list(nnx.iter_graph(model))
  done = [("/".join(str(k) for k in p) or "<top>") for p, n in nodes
          if any(k.__dict__.get("_jmem_site", ("guard",))[0] in ("bn", "block", "between")
                 for k in type(n).__mro__)]
  if done:
    raise ValueError(
        f"This NNX model was already converted (sites at {', '.join(done[:6])}). Convert it once "
        "with every technique, jmem.convert(model, t1, t2, ...), so that jmem can check how "
        "they stack; start again from the unconverted model.")
  actions = []          # applied only once every check has passed: no half-converted model
  by_path = {tuple(p): n for p, n in nodes}
  # Containers (nnx.List, nnx.Dict) have no __call__: never sites, transparent for the
  # "direct children of the top module" default.
  modules = [(tuple(p), n) for p, n in nodes if isinstance(n, nnx.Module) and _callable(n)]
  name = lambda p: "/".join(str(k) for k in p)
  seen = [name(p) for p, _ in modules]

  def top_child(p):
    return p != () and not any(isinstance(by_path.get(p[:k]), nnx.Module) and
                               _callable(by_path[p[:k]]) for k in range(1, len(p)))

  pairs = bn_activation_pairs(m for _, m in modules)

  hits = {i: [] for i in range(len(techniques))}
  bn_plan, block_plan = {}, {}
  for p, m in modules:
    path = name(p)
    status = c.nnx_bn_status(m)
    for i, t in enumerate(techniques):
      if isinstance(t, Spatial):
        conv = isinstance(m, nnx.Conv) and len(m.kernel_size) == 2
        if conv and (t.where is None or t.matches_user(m, path)):
          if m.conv_general_dilated is not lax.conv_general_dilated:
            raise ValueError(f"Spatial: the convolution at {path!r} already has its own "
                             "conv_general_dilated; jmem.Spatial replaces that function. Leave "
                             "this module out with where=.")
          actions.append(functools.partial(
              setattr, m, "conv_general_dilated",
              spatial_sharded.sharded_conv(t.mesh, t.axes, t.data_axis, where=path)))
          hits[i].append(path)
        elif t.where is not None and t.names(type(m), path) and not conv:
          raise ValueError(f"Spatial: where= names {c.describe(m)} at {path!r}, which is not a "
                           "2-D nnx.Conv; a path regex over a block selects the convolutions "
                           "inside it.")
        continue
      if isinstance(t, (SyncBN, InPlaceABN)):
        if t.where is None:
          if status in ("override", "lookalike"):
            raise ValueError(
                f"{type(t).__name__}: {c.describe(m)} at {path!r} "
                f"{'overrides nnx.BatchNorm.__call__' if status == 'override' else 'keeps BatchStat mean/var but is not an nnx.BatchNorm'}"
                ", so jmem cannot know what it computes. Name it in where= (its class or path) "
                f"to have its call replaced by {type(t).__name__}'s computation with its "
                "attributes and variables, or leave it out with a where= that does not match it.")
          take = status == "bn"
        else:
          take = t.matches_user(m, path) and status is not None   # a filter over BNs
          if take and status != "bn" and not t.names(type(m), path):
            raise ValueError(f"{type(t).__name__}: where= matches {c.describe(m)} at {path!r} "
                             "only through a base class, and it is not a plain nnx.BatchNorm; "
                             "name its own class or path in where=.")
          if take:
            missing = [a for a in c.NNX_BN_ATTRS if not hasattr(m, a)]
            if missing:
              raise ValueError(f"{type(t).__name__}: {c.describe(m)} at {path!r} lacks "
                               f"nnx.BatchNorm's attributes {missing}.")
        if take:
          bn_plan.setdefault(id(m), (p, m, []))[2].append((i, t))
      else:
        kind = _block_kind(t, m, path, status, top_child(p))
        if kind is not None:
          block_plan.setdefault(id(m), (p, m, []))[2].append((i, t, kind))

  # Block sites, outermost first: a site inside another one is covered by it, in part or in
  # whole, or applied inside it (`_common.nested_site`).
  block_paths = {}
  for p, m, found in block_plan.values():
    c.check_sbp_alone(found, name(p))
    block_paths[p] = found
  applied = {}
  for p in sorted(block_paths, key=len):
    enclosing = [(*applied[q], name(q)) for q in sorted(applied, key=len)
                 if q != p and p[:len(q)] == q]
    site = c.nested_site(block_paths[p], name(p), enclosing)
    if site is not None:
      applied[p] = site

  for p, m, found in bn_plan.values():
    path = name(p)
    kinds = {type(t): (i, t) for i, t in found}
    if len(found) > 2 or (len(found) == 2 and set(kinds) != {SyncBN, InPlaceABN}):
      raise ValueError(f"Several BatchNorm techniques take the module at {path!r}: "
                       f"{[t for _, t in found]}; give them disjoint where=.")
    sync = kinds.get(SyncBN, (None, None))[1]
    if InPlaceABN in kinds:
      _, t = kinds[InPlaceABN]
      entry = pairs.get(id(m))
      if m.scale is None or m.bias is None:
        raise ValueError(f"InPlaceABN: the BatchNorm at {path!r} has no scale or bias; "
                         "InPlace-ABN inverts its affine step and needs both.")
      axis_name, groups = c.bn_axis(t, sync, m)
      cfg = c.abn_config(t, None if entry is None else entry[0], path, m.epsilon, axis_name,
                         groups)
      if entry is not None and entry[0][0] != "other":
        actions.append(functools.partial(entry[1].layers.__setitem__, entry[2], _identity))
      actions.append(functools.partial(_set_class, m, _subclass(
          type(m), "bn", ("abn", path, (cfg, t.implementation, t.unbiased_running_var)),
          _bn_call)))
    else:
      _, t = found[0]
      axis_name, groups = c.bn_axis(t, None, m)
      actions.append(functools.partial(_set_class, m, _subclass(
          type(m), "bn", ("sync", path, (axis_name, groups, t.unbiased_running_var,
                                         t.implementation)),
          _bn_call)))
    for i, _ in found:
      hits[i].append(path)

  # BatchNorm-like modules that are not BatchNorm sites raise if a batch_mask is active
  # (they would ignore it); otherwise they run as before. Before the block classes, which
  # wrap them.
  for p, m in modules:
    if c.nnx_bn_status(m) is not None and id(m) not in bn_plan:
      actions.append(functools.partial(_set_guard_class, m, name(p)))
  # Attention and dropout layers see an SBP site's tape (they change nothing outside one).
  if any(spec is None for _, spec in applied.values()):
    for p, m in modules:
      if isinstance(m, nnx.MultiHeadAttention):
        actions.append(functools.partial(_set_class, m, _subclass(
            type(m), "sbp-attention", ("attention", name(p), None), _attention_call)))
      elif isinstance(m, nnx.Dropout):
        actions.append(functools.partial(_set_class, m, _subclass(
            type(m), "sbp-dropout", ("dropout", name(p), None), _dropout_call)))
  for p, (found, spec) in applied.items():
    path = name(p)
    if spec is None:
      cfg = ("sbp", path, found[0][1])
    else:
      cfg = ("remat" if spec.name == "recompute" else spec.name, path, spec)
      probe = c.probe_of(found)
      cfg += (probe,) if probe is not None else ()
    actions.append(functools.partial(_set_block_class, by_path[p], cfg))
  for p, found in block_paths.items():
    for i, _, _ in found:
      hits[i].append(name(p))

  c.check_all_matched(techniques, hits, seen, "module")
  c.check_coverage(techniques, hits, {
      name(p): (type(m), c.conv_like(_kernel_value(m)))
      for p, m in modules}, type(model).__name__)
  if any(t.compacts_between_sites for t in techniques):
    # Last: the top module's call wraps every site (its own included, where it is one).
    # (Its class is read when the action runs: after the site classes set on it, if any.)
    actions.append(lambda: _set_class(model, _subclass(
        type(model), "between", ("between",), _between_call)))
  for action in actions:
    action()
  return model


def _guard_call(base, cfg):
  path, status = cfg[1], cfg[2]

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    if c.active_mask() is not None and not getattr(base, "_jmem_reads_batch_mask", False):
      raise ValueError(
          f"jmem.batch_mask is active but the BatchNorm-like module at {path!r} is not a jmem "
          "site, so it would ignore the mask: include it in a jmem.SyncBN() (axis_name=None "
          "for local statistics) or jmem.InPlaceABN() where=.")
    if sbp_sites.active_tape() is not None:
      if status != "bn":
        raise ValueError(
            f"jmem.SBP: {c.describe(self)} at {path!r} keeps BatchNorm statistics inside an SBP "
            "site, where jmem computes BatchNorm itself (all-node statistics, held constant in "
            "the backward), but it is not an nnx.BatchNorm (or overrides its __call__), so jmem "
            "does not know its computation. Replace it by nnx.BatchNorm (or a per-sample norm "
            "such as nnx.GroupNorm), or name it in jmem.SyncBN(axis_name=None, where=...).")
      x, *rest = args
      use_ra = kwargs.get("use_running_average", rest[0] if rest else None)
      use_ra = self.use_running_average if use_ra is None else use_ra
      return _normalize(self, x, use_ra, kwargs.get("mask"),
                        sync_bn._sync_train_fn(self.axis_name, self.axis_index_groups,  # pylint: disable=protected-access
                                               self.epsilon),
                        sync_bn._bn_eval_fn(self.epsilon), False, path)  # pylint: disable=protected-access
    return base.__call__(self, *args, **kwargs)

  return __call__


def _attention_call(base, cfg):
  path = cfg[1]

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    tape = sbp_sites.active_tape()
    if tape is None:
      return base.__call__(self, *args, **kwargs)
    deterministic = kwargs.get("deterministic")
    deterministic = self.deterministic if deterministic is None else deterministic
    done = c.sbp_attention(tape, path, self.dropout_rate > 0 and not deterministic,
                           functools.partial(base.__call__, self), args, kwargs)
    return base.__call__(self, *args, **kwargs) if done is None else done[0]

  return __call__


def _dropout_call(base, cfg):
  path = cfg[1]

  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    tape = sbp_sites.active_tape()
    if tape is not None and tape.mode == "record":
      deterministic = kwargs.get("deterministic")
      deterministic = self.deterministic if deterministic is None else deterministic
      if self.rate > 0 and not deterministic:
        tape.dropout = f"the Dropout at {path!r}"
    return base.__call__(self, *args, **kwargs)

  return __call__


def _set_class(module, cls):
  module.__class__ = cls


def _set_guard_class(module, path):
  module.__class__ = _subclass(type(module), "guard", ("guard", path, c.nnx_bn_status(module)),
                               _guard_call)


def _set_block_class(module, cfg):
  # After any BatchNorm class change of the same module: the block wraps it. A probing
  # class (`jmem.surgery.sensitivities`, one per probe) is not kept for reuse.
  module.__class__ = _subclass(type(module), "block", cfg, _block_call, cache=len(cfg) == 3)


def _callable(m) -> bool:
  return any("__call__" in k.__dict__ for k in type(m).__mro__[:-1])


def _block_kind(t, m, path, status, top_child):
  if isinstance(t, SBP):
    return "sbp" if t.matches_user(m, path) else None
  if isinstance(t, (Remat, Policy)):
    take = (top_child and not c.is_head(m)) if t.where is None else t.matches_user(m, path)
    return ("remat" if isinstance(t, Remat) else "policy") if take else None
  lv = t.resolved_level()
  if t.where is None:
    if lv.block_bits is not None:
      return "block" if top_child and not c.is_head(m) else None
    if lv.conv_bits is not None and isinstance(m, nnx.Conv):
      return "conv"
    if lv.norm_bits is not None and status == "bn":
      return "norm"
    return None
  if not t.matches_user(m, path):
    return None
  if lv.block_bits is not None:
    return "block"
  if lv.norm_bits is not None and status is not None:
    return "norm"
  return "conv" if lv.conv_bits is not None else None

