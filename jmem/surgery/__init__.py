"""`jmem.convert`: jmem's techniques on a Flax model someone else wrote (linen or NNX).

::

  model = jmem.convert(model, jmem.ActNN("L3"))                    # any linen or NNX model
  model = jmem.convert(model, jmem.SyncBN(axis_name="batch"), jmem.Remat())
  model = jmem.convert(model, jmem.Policy("recompute_compressed", bits=2, where=r"stage.*"))
  model = jmem.convert(model, jmem.InPlaceABN(where=r"features/.*"))
  model = jmem.convert(model, jmem.SBP(keep_ratio=0.25, axis=1, where=FrameEncoder))
  model = jmem.convert(model, jmem.Spatial(mesh, axes=("h", "w")))

**Sites are module calls.** A technique applies to the calls of the modules its ``where=``
selects (module classes and/or regular expressions over "/"-joined module paths; see
`jmem._technique`). Code that a module runs in its own body (``nn.relu(x)``,
``jnp.mean(x, (1, 2))``) is covered only when an enclosing module is a site: a block site
(`Remat`, `ActNN` L3+) recomputes or compresses everything its module computes, inline code
included; nothing outside module calls can be reached.

**The variable tree does not change.** A converted linen model is a wrapper sharing the
model's scope (``nn.share_scope``): ``init``/``apply`` take and give the same variables, so
parameters and checkpoints of the original apply to the converted model and back, bit for
bit in the forward pass (InPlace-ABN's ``|scale| + epsilon`` is the one exception:
`inplace_abn_params`). An NNX model is changed in place: each site module's class becomes a
subclass of its own (same name and attributes), so ``nnx.state`` is unchanged.

**Execution model.** A converted model runs under ``jax.jit`` over (possibly sharded) global
arrays, or inside ``jax.shard_map`` as per-device code. `Remat` and `ActNN` work in both.
`SyncBN` and a synchronised `InPlaceABN` (``axis_name=``) are per-device code and need
``shard_map`` (an unbound axis name raises NameError saying so); under plain ``jit`` XLA
already computes BatchNorm statistics over the global batch, so they are not needed there.
`Spatial` is global code under plain ``jit``: its input sharded over H/W, its convolutions
exchange halos in nested ``shard_map``s (`jmem.parallel.spatial.sharded`), XLA partitions the
rest; it raises inside ``shard_map``. `SBP` is tested under ``jit``.

**Stacking.** ``convert(model, *techniques)`` applies them together: BatchNorm techniques
(`SyncBN`, `InPlaceABN`; both on one BatchNorm = synchronised InPlace-ABN) with block
techniques (`Remat`, `ActNN`, `Policy`) on any sites. `Remat` and `ActNN` on the same site
recompute it from a compressed input (`jmem.ops.policy`: ``Policy("recompute_compressed")``
at ActNN's bits, the masks and statistics of the forward pass kept exact). A block site
inside another block site of a different technique applies inside it (compression inside
a recomputed block runs in the recomputation; recomputation inside a compressed block
recomputes from the compressed residuals, its masks and statistics kept exact); a
technique that takes both covers the inner site through the outer one
(`_common.nested_site`). Refused, naming the module: a `Policy` sharing a site with
another block technique, two compressions or two recomputations of one site, a compressed
site inside a compressed (not recomputed) one, a ``Policy("save")`` site inside another
kind, and SBP with any other block technique on or around its sites.

**No silent no-op.** A technique whose ``where=`` matches nothing raises; so does a
BatchNorm technique meeting a BatchNorm-like module it does not recognise (a subclass with
its own ``__call__``, a look-alike with ``batch_stats`` mean/var) unless ``where=`` names it,
and InPlace-ABN on a BatchNorm whose activation it cannot see or is not invertible.

**SBP.** `SBP` sites (``where=`` required) run their forward on every node and their
backward on the kept ones (`jmem.ops.sbp.sites`); BatchNorm in training mode inside a site
uses its all-node statistics, held constant in the backward; a recognised attention over
the nodes makes the backward re-run the kept queries against every key and value.

**Masks.** `batch_mask` passes a validity mask to every converted BatchNorm site of a model
whose own calls pass none.

**Randomness.** ActNN's stochastic rounding (and a quantizing `Policy`'s) takes its key
from the RNG stream ``"actnn"``, SBP's kept nodes from ``"sbp"``: ``jmem.rngs(key)`` makes
both (and ``"dropout"``) from one key, for linen ``apply(..., rngs=jmem.rngs(key))`` or, for
NNX and plain code, as a context, ``with jmem.rngs(key): y = model(x)``. A site that is
differentiated without its key raises ValueError naming the streams; inference needs no
key. The one switch back to keys drawn from the data (they repeat for a repeated batch) is
`data_keys`: ``with jmem.surgery.data_keys(): ...`` around the model's call.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from jmem.ops.actnn import levels as actnn_lib
from jmem.ops.actnn import quantize as quantize_lib
from jmem.surgery import _common
from jmem.surgery._common import CoverageWarning as CoverageWarning
from jmem.surgery._common import NothingMatched as NothingMatched
from jmem.surgery._common import batch_mask as batch_mask
from jmem.surgery._common import data_keys as data_keys
from jmem.surgery._common import rngs as rngs
from jmem._technique import BenchTechnique
from jmem._technique import Technique as Technique
from jmem.ops.actnn.technique import ActNN as ActNN
from jmem.ops.inplace_abn import core as inplace_abn_core
from jmem.ops.inplace_abn.technique import InPlaceABN as InPlaceABN
from jmem.ops.policy import Policy as Policy
from jmem.ops.remat import Remat as Remat
from jmem.ops.sbp.technique import SBP as SBP
from jmem.parallel.spatial.technique import Spatial as Spatial
from jmem.parallel.sync_bn.technique import SyncBN as SyncBN
from jmem.techniques import convert_technique_names as technique_names
from jmem.techniques import register_technique
from jmem.techniques import technique as technique

__all__ = ["convert", "Technique", "TECHNIQUE_TYPES", "Remat", "ActNN", "Policy", "SyncBN",
           "InPlaceABN", "SBP", "Spatial", "technique", "technique_names", "batch_mask", "rngs",
           "data_keys",
           "sites", "inplace_abn_sites", "inplace_abn_params", "sensitivities", "calibrate",
           "gradient_noise",
           "convert_nnx", "NothingMatched", "CoverageWarning"]


# What `convert` takes (tests/test_pairs.py holds every pair of them to a test).
TECHNIQUE_TYPES = (Remat, ActNN, Policy, SyncBN, InPlaceABN, SBP, Spatial)


def convert(model, *techniques: Technique | None):
  """``model`` with ``techniques`` applied (module docstring).

  Args:
    model: an unbound linen ``Module`` (a converted linen module is returned, with the same
      ``init``/``apply`` and variables) or an NNX ``Module`` (changed in place and
      returned).
    *techniques: `Remat`, `ActNN`, `Policy`, `SyncBN`, `InPlaceABN`, `SBP`, `Spatial`
      objects, or bench names
      (``"actnn-L3"``, see `technique`); None (``technique("exact")``) is skipped.

  Raises:
    TypeError: ``model`` is not a Flax module, or a technique is not one.
    ValueError: a technique matches nothing (`NothingMatched`, a ValueError) or meets a
      module it cannot handle (the message names the module path and what to do).
  """
  resolved = []
  for t in techniques:
    if isinstance(t, str):
      t = technique(t)
    if t is None:
      continue
    if not isinstance(t, TECHNIQUE_TYPES):
      raise TypeError(f"jmem.convert takes technique objects (jmem.Remat(), jmem.ActNN('L3'), "
                      f"jmem.Policy(...), jmem.SyncBN(...), jmem.InPlaceABN(...), "
                      f"jmem.SBP(...), jmem.Spatial(mesh)) or bench names, got {t!r}.")
    resolved.append(t)
  _common.check_sbp_where(resolved)
  if isinstance(model, nn.Module):
    from jmem.surgery import _linen  # pylint: disable=g-import-not-at-top
    return _linen.convert_linen(model, tuple(resolved)) if resolved else model
  if isinstance(model, nnx.Module):
    from jmem.surgery import _nnx  # pylint: disable=g-import-not-at-top
    return _nnx.convert_nnx(model, tuple(resolved)) if resolved else model
  raise TypeError(f"jmem.convert takes a flax.linen or flax.nnx Module, got "
                  f"{type(model).__name__}.")


def sensitivities(model, loss_fn, params, batch, technique: ActNN | None = None, *,
                  seed: int = 0, bits: int | None = None
                  ) -> tuple[dict[str, float], dict[str, int]]:
  """GACT gradient sensitivity of each site ``technique`` (default ``ActNN("L3")``; its
  ``where=`` chooses the sites) compresses in ``model`` (linen, or NNX: probed through
  ``nnx.clone`` copies, yours is not converted): per site path, ``C``
  (the gradient variance the site adds at ``b`` bits is about ``C / (2^b - 1)^2``,
  `jmem.ops.actnn.levels`) and the number of values it quantizes. ``loss_fn``, ``params``,
  ``batch`` and ``seed`` as in `calibrate`, which allocates bits from GACT's 1-bit
  estimate; ``bits``: measure at ``bits`` instead (`jmem.ops.actnn.sensitivities`), as
  `jmem.plan` does at 2 to order its bit reductions."""
  technique = ActNN("L3") if technique is None else technique
  if not isinstance(technique, ActNN):
    raise TypeError(f"calibrate and sensitivities probe ActNN's sites; got {technique!r}.")
  lv = technique.resolved_level()
  if lv.block_bits is None:
    raise ValueError(f"calibrate and sensitivities need an L3-L5 level (block sites); got "
                     f"{lv.name}.")
  # An NNX model is probed through a copy: converting it changes it in place.
  copy = nnx.clone if isinstance(model, nnx.Module) else lambda m: m
  probing = lambda probe: convert(copy(model), dataclasses.replace(technique, probe=probe))
  return actnn_lib.sensitivities(model, loss_fn, params, batch, level=lv, seed=seed,
                                 probing_model=probing, bits=bits)


def calibrate(model, loss_fn, params, batch, technique: ActNN | None = None, *,
              budget: float | None = None, seed: int = 0) -> ActNN:
  """``technique`` (default ``ActNN("L3")``) with per-site bits from gradient sensitivity,
  for any linen or NNX model: `jmem.ops.actnn.calibrate`'s method (GACT sensitivities,
  ActNN's greedy allocation at ``budget`` average bits, default the level's) on the sites
  that ``technique`` selects in ``model``.

  Args:
    model: the unconverted linen or NNX model (NNX: probed through copies, left as it is).
    loss_fn: ``loss_fn(module, params, batch) -> scalar``, called with a probing conversion
      of ``model`` (same parameters; NNX: ``nnx.merge`` the module's graph with
      ``params``, an ``nnx.Param`` state, as `jmem.step.model_fns` does).
    params, batch: the weights and the calibration batch.
    technique: an L3-L5 `ActNN` (its ``where=`` chooses the sites).
    budget: average bits (default: the level's block bits).
    seed: dither seed of the probes.

  Returns:
    An `ActNN` whose level carries the per-site bits: ``jmem.convert(model, result)``.
  """
  technique = ActNN("L3") if technique is None else technique
  sens, weights = sensitivities(model, loss_fn, params, batch, technique, seed=seed)
  lv = technique.resolved_level()
  bits = actnn_lib.allocate_bits(sens, weights, budget=float(
      lv.block_bits if budget is None else budget))
  level = dataclasses.replace(lv, name=f"{lv.name}-calibrated", layer_bits=tuple(bits.items()))
  return dataclasses.replace(technique, level=level, bits=None)


def gradient_noise(model, loss_fn, params, batch, technique: ActNN | None = None, *,
                   num_seeds: int = 8) -> float:
  """Mean ``|g_q - g|^2`` over ``num_seeds`` dithers of the gradient with every site of
  ``technique`` (default ``ActNN("L3")``; a calibrated one keeps its per-site bits) at its
  bits, ``g`` the exact gradient: what `calibrate`'s allocation minimises. Arguments as in
  `calibrate`."""
  technique = ActNN("L3") if technique is None else technique
  if not isinstance(technique, ActNN):
    raise TypeError(f"gradient_noise probes ActNN's sites; got {technique!r}.")
  copy = nnx.clone if isinstance(model, nnx.Module) else lambda m: m
  probing = lambda probe: convert(copy(model), dataclasses.replace(technique, probe=probe))
  return actnn_lib.gradient_noise(model, loss_fn, params, batch, technique.resolved_level(),
                                  num_seeds=num_seeds, probing_model=probing)


def convert_nnx(model: nnx.Module, level="L3", *,
                block_types: tuple[type, ...] = (),
                implementation: str | None = None) -> nnx.Module:
  """An ActNN level on an NNX model, in place (and returned): `jmem.ops.actnn.convert` for
  Flax NNX.

  L1/L2 compress every ``nnx.Conv`` (and, at L2, ``nnx.BatchNorm``) at 4 bits. L3+ compress
  every instance of ``block_types`` at ``block_bits`` (the GACT way); with no
  ``block_types`` they compress convolutions and batch norms at ``block_bits``. ``L0``
  changes nothing. ``implementation`` as in `jmem.ops.actnn.convert`. The state paths do not change (each
  site keeps its place and its attributes; see `jmem.convert`, of which this is the
  ``jmem.ActNN(level, where=block_types)`` case).
  """
  lv = actnn_lib.get_level(level)
  if lv.block_bits is not None or lv.conv_bits is not None or lv.norm_bits is not None:
    where = None
    if lv.block_bits is not None:
      where = tuple(block_types) or (nnx.Conv, nnx.BatchNorm)
    convert(model, ActNN(lv, where=where, implementation=implementation))
  return model


_SITES: contextvars.ContextVar = contextvars.ContextVar("jmem_sites", default=None)


def sites(model, *args, rngs=None, **kwargs) -> dict[str, list[str]]:
  """The module paths a converted ``model``'s techniques apply to.

  linen: found by tracing ``model.apply`` on ``args`` (shapes only, nothing runs; ``rngs``
  as ``apply`` takes them, e.g. ``{"dropout": key}``); keys are the techniques' reprs. NNX:
  read from the model; keys are the site kinds (``"remat"``, ``"compress"``,
  ``"recompute_compressed"``, ``"offload"``, ``"save"``, ``"sbp"``, ``"sync"``, ``"abn"``).
  """
  if isinstance(model, nnx.Module):
    out: dict[str, list[str]] = {}
    for p, m in nnx.iter_graph(model):
      for klass in type(m).__mro__ if isinstance(m, nnx.Module) else ():
        site = klass.__dict__.get("_jmem_site")
        if site is not None and site[1][0] not in ("guard", "between"):
          out.setdefault(site[1][0], []).append("/".join(str(k) for k in p))
    return out
  from jmem.surgery import _linen  # pylint: disable=g-import-not-at-top
  if not isinstance(model, _linen.Converted):
    raise TypeError("sites() takes a model returned by jmem.convert.")
  collected: dict = {}
  token = _linen.RECORD.set(collected)
  try:
    streams = {"params": jax.random.key(0), **_common.rngs(jax.random.key(0)), **(rngs or {})}
    jax.eval_shape(lambda: model.apply(
        model.init(streams, *args, **kwargs), *args, mutable=True, rngs=streams, **kwargs))
  finally:
    _linen.RECORD.reset(token)
  return {repr(model.techniques[i]): sorted(set(p)) for i, p in collected.items()}


def inplace_abn_sites(model, *args, **kwargs) -> list[str]:
  """The paths of the BatchNorms an `InPlaceABN` can take in the unconverted ``model``:
  a plain ``nn.BatchNorm`` / ``nnx.BatchNorm`` with scale and bias, followed in an
  ``nn.Sequential`` / ``nnx.Sequential`` by an invertible activation (``leaky_relu`` with
  a slope > 0, ``elu`` with alpha > 0). ``InPlaceABN(where=...)`` over them converts; an
  `InPlaceABN` without ``where=`` raises on any other BatchNorm. linen: found by tracing
  ``model.init`` on ``args`` (shapes only, nothing runs); NNX: read from the model."""
  def invertible(pair) -> bool:
    return (pair is not None and pair[0] != "other" and
            pair[1].get("slope", 1.0) > 0 and pair[1].get("alpha", 1.0) > 0)

  if isinstance(model, nnx.Module):
    from jmem.surgery import _nnx  # pylint: disable=g-import-not-at-top
    nodes = {id(m): ("/".join(str(k) for k in p), m) for p, m in nnx.iter_graph(model)}
    pairs = _nnx.bn_activation_pairs(m for _, m in nodes.values())
    return sorted(path for i, (path, bn) in nodes.items() if i in pairs and
                  _common.nnx_bn_status(bn) == "bn" and bn.scale is not None and
                  bn.bias is not None and invertible(pairs[i][0]))
  if not isinstance(model, nn.Module):
    raise TypeError(f"inplace_abn_sites takes a flax.linen or flax.nnx Module, got "
                    f"{type(model).__name__}.")
  found = set()

  def record(next_fun, args_, kwargs_, context):
    mod = context.module
    if isinstance(mod, nn.Sequential) and context.method_name == "__call__":
      layers = list(mod.layers)
      found.update("/".join(bn.scope.path) for bn, fn in zip(layers, layers[1:])
                   if type(bn) is nn.BatchNorm and bn.use_scale and bn.use_bias  # pylint: disable=unidiomatic-typecheck
                   and invertible(_common.activation_of(fn)))
    return next_fun(*args_, **kwargs_)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, *args, **kwargs))
  return sorted(found)


def inplace_abn_params(params: Mapping[str, Any], paths, *, to: str = "inplace_abn",
                       epsilon: float = 1e-5):
  """Maps the BatchNorm ``scale`` parameters at ``paths`` (e.g. ``sites(model, x)`` of an
  `InPlaceABN` technique) between plain BatchNorm and InPlace-ABN.

  ``to="inplace_abn"``: ``s -> s - epsilon`` (InPlace-ABN's effective scale ``|γ| + ε`` then
  equals ``s``; needs ``s >= epsilon``, see `jmem.ops.inplace_abn.from_batch_norm_scale`);
  ``to="batch_norm"``: ``γ -> |γ| + ε``. ``params`` is a linen ``params`` dict (nested by
  path), or an NNX ``nnx.State`` of parameters; a new tree is returned.
  """
  from jmem.ops import inplace_abn as abn  # pylint: disable=g-import-not-at-top
  if to not in ("inplace_abn", "batch_norm"):
    raise ValueError(f"to must be 'inplace_abn' or 'batch_norm', got {to!r}.")
  fn = ((lambda s: abn.from_batch_norm_scale(s, epsilon)) if to == "inplace_abn"
        else (lambda s: abn.to_batch_norm_scale(s, epsilon)))
  is_state = isinstance(params, nnx.State)
  tree = dict(nnx.to_pure_dict(params) if is_state else params)   # containers copied on the
  for path in paths:                                                # way down to each scale
    node = tree
    keys = [k for k in path.split("/") if k]
    for k in keys:
      k2 = int(k) if (k not in node and k.isdigit()) else k
      node[k2] = dict(node[k2])
      node = node[k2]
    if "scale" not in node:
      raise ValueError(f"No 'scale' parameter at {path!r}.")
    node["scale"] = fn(node["scale"])
  if is_state:
    out = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(out, tree)
    return out
  return tree


# ------------------------------------------- Policy and InPlace-ABN names in the registry

def _policy_record(name: str, policy: Policy, description: str):
  """A registry record of ``policy`` on default sites (the top module's children but its
  Dense layers, as ActNN L3's and remat's)."""
  quantizes = policy.bits is not None

  def with_implementation(implementation):
    return dataclasses.replace(policy, implementation=implementation) if quantizes else policy

  return BenchTechnique(name, with_implementation, description, has_kernels=quantizes,
                        kernel_ops=quantize_lib.OPS if quantizes else ())


def _inplace_abn_pairs(model, dataset, batch_size, techniques, *, target=None):
  """The bench's ``inplace-abn``: `InPlaceABN` on every BatchNorm + invertible activation
  pair of ``model`` (`inplace_abn_sites`), which a BatchNorm followed by anything else
  would refuse; a model with no such pair is refused, saying why."""
  del batch_size, target
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  x = jnp.zeros((2,) + tuple(dataset.example_shape), jnp.float32)
  paths = inplace_abn_sites(model, x)
  if not paths:
    raise ValueError(
        f"Technique 'inplace-abn' found no BatchNorm followed by an invertible activation "
        f"(leaky_relu with a slope > 0, elu; in an nn.Sequential) in {type(model).__name__}: "
        "InPlace-ABN reconstructs the BatchNorm output from the activation's, which ReLU "
        "does not allow.")
  where = tuple(re.escape(p) for p in paths)
  return tuple(dataclasses.replace(t, where=where) if isinstance(t, InPlaceABN) else t
               for t in techniques)


for _record in (
    _policy_record("recompute-2bit", Policy("recompute_compressed", bits=2),
                   "Policy recompute_compressed: each block recomputed from a 2-bit copy of "
                   "its input (masks and statistics exact)"),
    _policy_record("offload", Policy("offload"),
                   "Policy offload: each block's residuals in pinned host memory, full "
                   "precision (on CPU host and device memory are one)"),
    _policy_record("offload-2bit", Policy("offload", bits=2),
                   "Policy offload with bits=2: each block's residuals at 2 bits in pinned "
                   "host memory"),
    BenchTechnique("inplace-abn", lambda implementation: InPlaceABN(
        implementation=implementation), "In-Place Activated BatchNorm on every BatchNorm + "
        "invertible activation pair, saves only outputs", prepare=_inplace_abn_pairs,
        has_kernels=True, kernel_ops=inplace_abn_core.OPS),
):
  register_technique(_record)
