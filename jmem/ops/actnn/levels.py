"""ActNN compression levels for Flax linen models: compressed ops and compressed blocks.

Two ways, one quantizer (`jmem.ops.actnn.quantize`):

* ActNN's way (L1, L2): each convolution (and, at L2, BatchNorm) saves a 4-bit copy of its
  input instead of the input.
* GACT's way (L3-L5): each site (a block, the stem: ``jmem.convert(model, jmem.ActNN())``'s
  default sites are the top module's children but its Dense layers) is compressed whole,
  so that EVERY floating residual inside it - convolution inputs, normalisation
  intermediates, activation inputs, the block's own input - is stored at 2 bits (on
  average, per-site widths from `jmem.surgery.calibrate`); parameters are never
  compressed. `compressed` does the same to a module class, as ``nn.remat`` does.

Levels (frozen `Level` objects; build your own the same way):

====  =============================================================================
L0    exact
L1    4-bit convolutions (ActNN way); BatchNorm and activations uncompressed
L2    L1 + 4-bit BatchNorm
L3    every floating residual of every block and of the stem at 2 bits (GACT way),
      per-layer 1/2/4/8 bits averaging 2 once calibrated (below); only the classifier
      head (a pooled vector) stays exact
L4    L3 with the compressed residuals moved to host memory (``pinned_host``) until the
      backward pass
L5    L4 with groups of 1024 instead of 256: the min/scale metadata (float32 + bf16)
      falls from 6/256 to 6/1024 bytes per value, i.e. from 9.4% to 2.3% on top of the
      2-bit codes
      (ActNN's L5 was allocator defragmentation, which XLA's static buffer assignment
      makes moot)
====  =============================================================================

Bit allocation (L3-L5). ``jmem.ActNN("L3")`` uses 2 bits at every site;
`jmem.surgery.calibrate` turns it into a per-site allocation with the same 2-bit average,
from gradient sensitivity (ActNN's and GACT's scheme; `sensitivities` and `allocate_bits`
here):

1. Sensitivity (GACT). For each compressed site i (a block, the stem), with every other
   site exact: two backprops with site i at 1 bit (two dither seeds) give g0, g1, one at 8
   bits gives g2, and ``C_i = max(|g0 - g1|^2, 2 max(|g0 - g2|^2, |g1 - g2|^2))``. The
   gradient variance site i adds at b bits is then about ``C_i / (2^b - 1)^2``. All 3 x
   sites backprops run one compiled function (`jmem.ops.actnn.quantize.probe`: the bit width is a
   traced number of levels), so calibration costs one compile.
2. Allocation (ActNN). Minimise ``sum_i C_i / (2^b_i - 1)^2`` subject to
   ``sum_i w_i b_i <= budget * sum_i w_i`` (w_i: values site i quantizes, b_i in
   {1, 2, 4, 8}): greedily from 8 bits down, lowering the site with the least added
   variance per bit saved until the budget holds, then raising, best first, any site
   the slack still affords (`allocate_bits`).

The schedule: calibrate once, before training, on one batch at the initial weights (what
the ``actnn-L3``..``L5`` bench techniques do); calibrate again to refresh it (each new
allocation compiles a new step, because bit widths fix buffer shapes). ActNN also
re-chose bits per sample every step; with static shapes jmem keeps the per-sample
adaptivity in the ranges (a min and scale per sample and group) and not in the widths.

Applying a level to a model, linen or NNX: ``jmem.convert(model, jmem.ActNN(level))``
(``jmem.surgery.convert_nnx`` is the same on NNX graphs).

The individual compressed operations (dense, conv, norms, gelu, attention, 1-bit ReLU /
dropout masks, max-pool indices) are in `jmem.ops.actnn.compressed_ops`.

References:
  Chen et al., ActNN, ICML 2021, https://arxiv.org/abs/2104.14129
  Liu et al., GACT, ICML 2022, https://arxiv.org/abs/2206.11357
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.core.lift as lift
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import scope as core_scope
from flax.linen import transforms as nn_transforms
from jax.flatten_util import ravel_pytree

from jmem._backends import check_implementation
from jmem.ops.actnn import quantize as q

__all__ = ["Level", "LEVELS", "get_level", "compressed", "CompressedNNX", "sensitivities",
           "allocate_bits", "gradient_noise"]


def _lift_sites(transform):
  """A lifted transform from ``transform(pure, path) -> g`` (``g(variable_groups,
  rng_groups, *arrays)``): the module's array arguments and its variables and rngs go
  through ``g``; Python values (e.g. ``train=True``) are closed over. ``path`` is the
  module's scope path, "/"-joined (how per-layer bits find their site)."""

  def lifted(fn, variables=True, rngs=True, **kw):
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
      is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in args]
      arrays = [a for a, k in zip(args, is_array) if k]

      def pure(variable_groups, rng_groups, *arrays):
        it = iter(arrays)
        full = [next(it) if k else a for a, k in zip(args, is_array)]
        scope = scope_fn(variable_groups, rng_groups)
        y = fn(scope, *full, **kwargs)
        return y, repack_fn(scope)
      scopes = jax.tree.leaves(scope_fn(variable_groups, rng_groups),
                               is_leaf=lambda s: isinstance(s, core_scope.Scope))
      path = "/".join(scopes[0].path) if scopes else ""
      return transform(pure, path, **kw)(variable_groups, rng_groups, *arrays)

    return lift.pack(inner, (variables,), (variables,), (rngs,), name="compress",
                     enable_kwargs=True)
  return lifted


def _compress_site(pure, path, *, bits, layer_bits, group_size, offload, implementation):
  return q.compress(pure, bits=layer_bits.get(path, bits), group_size=group_size,
                    param_argnums=(0, 1), offload=offload, implementation=implementation)


def compressed(target, *, bits: int = 2, group_size: int = 256, offload: bool = False,
               layer_bits: Mapping[str, int] | None = None, methods=None,
               implementation: str | None = None):
  """Lifted `jmem.ops.actnn.quantize.compress` for a linen Module class (like ``nn.remat``).

  ``compressed(nn.Conv, bits=4)`` is a Conv whose backward uses a 4-bit copy of its input;
  ``compressed(BasicBlock)`` compresses everything a block saves. ``layer_bits`` maps
  module paths ("/"-joined scope names, e.g. ``"stage1_block0"``) to their own bits (see
  `calibrate`); other instances use ``bits``. Static (non-array) arguments of the wrapped
  method must be passed as module attributes. ``implementation`` (``"xla"``, ``"pallas"``,
  ``None`` = automatic: XLA) picks the quantizer's backend
  (`jmem.ops.actnn.quantize.quantize`).
  """
  layer_bits = dict(layer_bits or {})
  for b in {bits, *layer_bits.values()}:
    q.check_config(b, group_size)
  check_implementation(implementation, q.OPS, "compressed")
  lifted = nn_transforms.lift_transform(
      _lift_sites(_compress_site), target, bits=bits, layer_bits=layer_bits,
      group_size=group_size, offload=offload, methods=methods, implementation=implementation)
  if isinstance(target, type):
    # Flax names the lifted class "Lifted<Name>", which renames auto-named submodules
    # ("LiftedBlock_0"): parameters and checkpoints of the plain model would not load.
    lifted.__name__, lifted.__qualname__ = target.__name__, target.__qualname__
  return lifted


@dataclasses.dataclass(frozen=True)
class Level:
  """An ActNN-style compression level.

  Attributes:
    name: "L0".."L5" or your own.
    conv_bits: bits of compressed convolutions (ActNN way), or None.
    norm_bits: bits of compressed BatchNorm (ActNN way), or None.
    block_bits: bits of whole compressed blocks and stem (GACT way), or None.
    layer_bits: per-site overrides of ``block_bits``, ``((module path, bits), ...)``, as
      `calibrate` allocates them.
    offload: compressed residuals live in host memory until the backward.
    group_size: quantization group size.
  """

  name: str
  conv_bits: int | None = None
  norm_bits: int | None = None
  block_bits: int | None = None
  layer_bits: tuple[tuple[str, int], ...] = ()
  offload: bool = False
  group_size: int = 256

  def __post_init__(self):
    object.__setattr__(self, "layer_bits", tuple(sorted(dict(self.layer_bits).items())))
    if self.layer_bits and self.block_bits is None:
      raise ValueError(f"Level {self.name}: layer_bits override block_bits; set block_bits "
                       "(the bits of sites not listed) too.")
    for bits in (self.conv_bits, self.norm_bits, self.block_bits,
                 *(b for _, b in self.layer_bits)):
      if bits is not None:
        q.check_config(bits, self.group_size)

  def average_bits(self, weights: Mapping[str, int]) -> float:
    """The ``weights``-weighted average bits of the block sites (`sensitivities` weights)."""
    bits = dict(self.layer_bits)
    total = sum(weights.values())
    return sum(w * bits.get(p, self.block_bits) for p, w in weights.items()) / max(total, 1)


LEVELS: dict[str, Level] = {
    "L0": Level("L0"),
    "L1": Level("L1", conv_bits=4),
    "L2": Level("L2", conv_bits=4, norm_bits=4),
    "L3": Level("L3", block_bits=2),
    "L4": Level("L4", block_bits=2, offload=True),
    "L5": Level("L5", block_bits=2, offload=True, group_size=1024),
}


def get_level(level: str | Level) -> Level:
  if isinstance(level, Level):
    return level
  if level not in LEVELS:
    raise ValueError(f"Unknown compression level {level!r}; valid levels: "
                     f"{', '.join(LEVELS)} (or a jmem.ops.actnn.Level).")
  return LEVELS[level]


# ------------------------------------------------------------------ per-layer bit allocation

LossFn = Callable[[nn.Module, Any, Any], jax.Array]   # (module, params, batch) -> scalar


class _Probe:
  """Trace-time state of a sensitivity probe: site order, site weights, traced levels."""

  def __init__(self):
    self.sites: dict[str, int] = {}
    self.weights: dict[str, int] = {}
    self.levels = None
    self.seed = None

  @contextlib.contextmanager
  def active(self, levels, seed):
    self.levels, self.seed = levels, seed
    try:
      yield
    finally:
      self.levels = self.seed = None

  def site(self, pure, path, *, group_size, arguments_only=False):
    index = self.sites.setdefault(path, len(self.sites))
    levels = (jnp.float32(0.0) if self.levels is None or index >= self.levels.shape[0]
              else self.levels[index])
    seed = (jnp.uint32(0) if self.seed is None else self.seed) + jnp.uint32(7919 * index)

    def record(n):
      self.weights[path] = n
    g = q.probe(pure, group_size=group_size, param_argnums=(0, 1), on_residuals=record,
                arguments_only=arguments_only)
    return functools.partial(g, levels, seed)


def _probe_grads(model, loss_fn, params, batch, lv, probing_model):
  """``(grads(levels, seed), sites, weights)``: one jitted gradient with a runtime number
  of quantization levels per site (``sites`` maps path -> index into ``levels``). The
  parameters and batch are jit arguments, never constants (XLA would fold them).
  ``probing_model(probe)``: the model whose sites call ``probe.site`` (`jmem.surgery.
  sensitivities` and `jmem.surgery.calibrate` build it with `jmem.convert`)."""
  del model
  if lv.block_bits is None:
    raise ValueError(f"Level {lv.name} compresses no blocks (block_bits is None): bit "
                     "allocation is for L3-style levels.")
  if probing_model is None:
    raise TypeError("The probe needs probing_model(probe), the model converted with its "
                    "sites probing: use jmem.surgery.sensitivities or jmem.surgery.calibrate, "
                    "which build it for any linen or NNX model.")
  probe = _Probe()
  probing = probing_model(probe)

  def grads(levels, seed, params, batch):
    with probe.active(levels, seed):
      return jax.grad(lambda p: loss_fn(probing, p, batch))(params)

  # A first trace finds the sites (levels of length 0: all exact).
  jax.eval_shape(grads, jnp.zeros((0,), jnp.float32), jnp.uint32(0), params, batch)
  if not probe.sites:
    raise ValueError("No compressed site was called: the probing model calls none of the "
                     "sites it was converted with.")
  jitted = jax.jit(grads)
  return (lambda levels, seed: jitted(levels, seed, params, batch)), dict(probe.sites), \
      dict(probe.weights)


def _flat(tree):
  return ravel_pytree(tree)[0]


def _sq_dist(a, b) -> float:
  """Squared distance of two flat gradients."""
  return float(jnp.sum(jnp.square(a - b)))


def sensitivities(model: nn.Module, loss_fn: LossFn, params: Any, batch: Any, *,
                  level: str | Level = "L3", seed: int = 0, probing_model=None,
                  bits: int | None = None, num_seeds: int = 2
                  ) -> tuple[dict[str, float], dict[str, int]]:
  """GACT gradient sensitivity of every site ``level`` compresses as a whole block.

  Args:
    model: the exact model.
    loss_fn: ``loss_fn(module, params, batch) -> scalar``; it is called with the probing
      model (the same params fit).
    params: the parameters to differentiate (the current weights).
    batch: the calibration batch (any pytree of arrays, e.g. ``(x, y)``).
    level: gives the group size (and must compress blocks: L3, L4, L5 or your own).
    seed: dither seed of the probes.
    probing_model: ``probing_model(probe) -> module`` whose sites call ``probe.site``
      (`jmem.surgery.sensitivities` builds it with `jmem.convert`; required).
    bits: None: GACT's estimate, from 1-bit probes. An int: measured at ``bits`` instead,
      ``C_i = (2^bits - 1)^2`` times the mean over ``num_seeds`` dithers of
      ``|g_i - g|^2`` (``g``: the exact gradient; ``g_i``: site i alone at ``bits``).
      On ResNet-20, ``C / 15^2`` from 2 bits came to 0.38-1.59x each site's measured
      4-bit variance, from the 1-bit probes to 0.14-0.43x, unevenly across sites
      (docs/decisions.md, "Planner": the plan_sensitivity study; `jmem.plan` measures at 2 bits).
    num_seeds: dithers per site when ``bits`` is given.

  Returns:
    ``(C, w)``: per site path, ``C_i`` (module docstring) and the number of values the site
    quantizes.
  """
  if bits is not None and (isinstance(bits, bool) or bits not in q.SUPPORTED_BITS or
                           num_seeds < 1):
    raise ValueError(f"bits must be among {q.SUPPORTED_BITS} and num_seeds at least 1, got "
                     f"{bits!r} and {num_seeds}.")
  grads, sites, weights = _probe_grads(model, loss_fn, params, batch, get_level(level),
                                       probing_model)
  out = {}
  if bits is not None:
    exact = _flat(grads(jnp.zeros((len(sites),), jnp.float32), jnp.uint32(0)))
    for path, i in sites.items():
      levels = jnp.zeros((len(sites),), jnp.float32).at[i].set(2.0**bits - 1)
      err = np.mean([_sq_dist(_flat(grads(levels, jnp.uint32(num_seeds * seed + k + 1))), exact)
                     for k in range(num_seeds)])
      out[path] = float(err) * (2.0**bits - 1) ** 2
    return out, weights
  for path, i in sites.items():
    one_hot = jnp.zeros((len(sites),), jnp.float32).at[i].set(1.0)
    g0 = _flat(grads(one_hot, jnp.uint32(2 * seed + 1)))
    g1 = _flat(grads(one_hot, jnp.uint32(2 * seed + 2)))
    g2 = _flat(grads(255.0 * one_hot, jnp.uint32(2 * seed + 1)))
    out[path] = max(_sq_dist(g0, g1), 2.0 * max(_sq_dist(g0, g2), _sq_dist(g1, g2)))
  return out, weights


def gradient_noise(model: nn.Module, loss_fn: LossFn, params: Any, batch: Any,
                   level: str | Level, *, num_seeds: int = 8, probing_model=None) -> float:
  """Mean ``|g_q - g|^2`` over ``num_seeds`` dithers with every site at ``level``'s bits
  (``layer_bits`` respected), ``g`` the exact gradient: what an allocation is meant to
  minimise. Uses the same probe as `sensitivities`."""
  lv = get_level(level)
  grads, sites, _ = _probe_grads(model, loss_fn, params, batch, lv, probing_model)
  bits = dict(lv.layer_bits)
  levels = np.zeros((len(sites),), np.float32)
  for path, i in sites.items():
    levels[i] = 2**bits.get(path, lv.block_bits) - 1
  exact = _flat(grads(np.zeros_like(levels), jnp.uint32(0)))
  return float(np.mean([_sq_dist(_flat(grads(levels, jnp.uint32(1000 + s))), exact)
                        for s in range(num_seeds)]))


def allocate_bits(sensitivity: Mapping[str, float], weights: Mapping[str, int], *,
                  budget: float = 2.0, choices: tuple[int, ...] = (1, 2, 4, 8)
                  ) -> dict[str, int]:
  """Bits per site minimising ``sum C_i / (2^b_i - 1)^2`` with average bits <= ``budget``.

  Greedy from the widest choice down (least added variance per bit saved first) until the
  weighted average fits, then the slack is spent raising the sites that gain the most per
  bit. ``weights`` are the values each site quantizes.
  """
  choices = tuple(sorted(set(choices)))
  if not choices or choices[0] > budget:
    raise ValueError(f"budget {budget} is below the narrowest choice of {choices}.")
  for c in choices:
    if c not in q.SUPPORTED_BITS:
      raise ValueError(f"choices must be among {q.SUPPORTED_BITS}, got {choices}.")
  if set(sensitivity) != set(weights):
    raise ValueError("sensitivity and weights must have the same sites.")
  var = lambda p, i: sensitivity[p] / float(2**choices[i] - 1) ** 2
  # Variance removed per budget bit by widening site p from choices[i] to choices[i + 1].
  gain = lambda p, i: (var(p, i) - var(p, i + 1)) / max(
      weights[p] * (choices[i + 1] - choices[i]), 1)
  level = {p: len(choices) - 1 for p in sensitivity}     # indices into choices
  cap = budget * sum(weights.values())
  used = lambda: sum(weights[p] * choices[level[p]] for p in level)
  while used() > cap:                                      # narrow the cheapest first
    p = min((p for p in level if level[p] > 0), key=lambda p: gain(p, level[p] - 1))
    level[p] -= 1
  while True:                                              # spend the slack, best first
    affordable = [p for p in level if level[p] < len(choices) - 1 and
                  used() + weights[p] * (choices[level[p] + 1] - choices[level[p]]) <= cap]
    if not affordable:
      return {p: choices[i] for p, i in level.items()}
    p = max(affordable, key=lambda p: gain(p, level[p]))
    level[p] += 1


# ------------------------------------------------------------------------------ Flax NNX

class CompressedNNX(nnx.Module):
  """An NNX module whose call saves ``bits``-bit copies of its residuals.

  The inner module's state (parameters, batch statistics, RNG counters) goes through
  `jmem.ops.actnn.quantize.compress` as the never-compressed first argument, and the updated state
  is written back, so BatchNorm statistics and dropout streams behave as before.
  """

  def __init__(self, inner: nnx.Module, *, bits: int = 2, group_size: int = 256,
               offload: bool = False, implementation: str | None = None):
    q.check_config(bits, group_size)
    check_implementation(implementation, q.OPS, "CompressedNNX")
    self.inner = inner
    self.bits, self.group_size, self.offload = bits, group_size, offload
    self.implementation = implementation

  def __call__(self, *args):
    graphdef, state = nnx.split(self.inner)

    def pure(state, *args):
      module = nnx.merge(graphdef, state)
      return module(*args), nnx.state(module)
    fn = q.compress(pure, bits=self.bits, group_size=self.group_size, param_argnums=(0,),
                    offload=self.offload, implementation=self.implementation)
    y, new_state = fn(state, *args)
    nnx.update(self.inner, new_state)
    return y
