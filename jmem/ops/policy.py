"""Per-site memory policies: what a site keeps for its backward pass, as one `jmem.convert`
technique (`Policy`), and what every block technique amounts to on a site (`SiteSpec`).

A site's residuals (what its backward pass reads) can be

* ``"save"``: kept as they are (the plain model; a plan names it for every site it leaves);
* ``"compress"``: stored at ``bits`` per value (ActNN's quantizer,
  `jmem.ops.actnn.quantize.compress`); with ``offload=True`` then moved to host memory;
* ``"recompute"``: dropped and recomputed from the site's inputs in the backward pass
  (``jax.checkpoint``; ``checkpoint_policy`` may keep some, e.g. ``dots_saveable``);
* ``"recompute_compressed"``: recomputed from a ``bits``-bit copy of the site's inputs,
  keeping the forward pass's masks (1 bit per value), batch statistics
  (`save_masks_and_statistics`) and values named `jmem._technique.EXACT_RESIDUAL` (an
  InPlace-ABN's output, which its backward inverts) exact, plus whatever
  ``checkpoint_policy`` saves, at full precision; the recomputation runs on the dequantized
  input, so the gradient is approximate, as any compression's;
* ``"offload"``: moved to host memory (``pinned_host``) until the backward pass, at full
  precision (exact), or compressed first with ``bits=``.

``jmem.convert(model, jmem.Remat(), jmem.ActNN("L3"))`` on the same sites is
``recompute_compressed`` at ActNN's bits (and its group size and offload). Sites are module
calls, selected by ``where=`` as for every technique (`jmem._technique`).

Exact: save, recompute, offload without bits. Approximate (unbiased stochastic rounding of
each stored value; the gradient's error falls with ``bits``): compress,
recompute_compressed, offload with bits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from jmem._backends import check_implementation
from jmem._technique import EXACT_RESIDUAL, Technique
from jmem.ops.actnn import quantize as q

__all__ = ["Policy", "POLICY_KINDS", "SiteSpec", "site_transform", "save_masks_and_statistics",
           "recomputed"]

POLICY_KINDS = ("save", "compress", "recompute", "recompute_compressed", "offload")
_WITH_BITS = ("compress", "recompute_compressed")


@dataclasses.dataclass(frozen=True)
class SiteSpec:
  """What one block site does with its residuals; hashable (NNX site classes key on it).

  ``recompute``: run the site under ``jax.checkpoint`` (``checkpoint_policy``), so its
  residuals are its inputs (and what the policy saves). ``bits``: store those residuals
  quantized (None: as they are). ``offload``: move what is stored to host memory.
  ``from_compressed``: the site recomputes inside an enclosing compressing site, from its
  compressed residuals (so it keeps masks and statistics exact, as with ``bits``).
  """

  recompute: bool = False
  checkpoint_policy: Any = None
  bits: int | None = None
  group_size: int = 256
  offload: bool = False
  implementation: str | None = None
  keep_masks_and_statistics: bool = True
  from_compressed: bool = False

  @property
  def name(self) -> str:
    """The policy kind this spec is (`POLICY_KINDS`)."""
    if self.recompute:
      return "recompute_compressed" if self.bits is not None else "recompute"
    if self.offload:
      return "offload"
    return "compress" if self.bits is not None else "save"

  @property
  def draws(self) -> bool:
    """Whether the site's transform takes a stochastic-rounding key."""
    return self.bits is not None

  @property
  def keeps_exact(self) -> bool:
    """Whether the recomputation keeps its masks, statistics and `EXACT_RESIDUAL` values
    (`save_masks_and_statistics`): it recomputes from a compressed input (its own or an
    enclosing site's), and only that input is quantized."""
    return (self.recompute and self.keep_masks_and_statistics and
            (self.bits is not None or self.from_compressed))

  @property
  def stores(self) -> bool:
    """Whether the site stores its residuals another way (compressed or offloaded)."""
    return self.bits is not None or self.offload


_COMPARISONS = frozenset({"gt", "ge", "lt", "le", "eq", "ne"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"})


def save_masks_and_statistics(prim, *avals, **params) -> bool:
  """A ``jax.checkpoint`` policy saving comparisons (the masks a ReLU's, a clip's or a
  ``where``'s derivative selects with) and reductions at least 16 times smaller than their
  input (BatchNorm's batch statistics, a global mean), recomputing everything else.

  What a recomputation from a compressed input needs to stay close to the forward pass: a
  mask recomputed from a quantized value flips near 0 (an error like the square root of the
  quantization step, not the step), and statistics recomputed from quantized values are
  biased (a variance grows by the quantization noise's). Inside jmem's `compress` the masks
  are bit-packed (1 bit per value, for masks of at least 1024 values in multiples of 8); as
  a plain ``jax.checkpoint`` policy they stay one byte per value. Statistics are per
  channel.
  """
  name = prim.name
  if name in _COMPARISONS:
    return True
  if name in _REDUCTIONS and avals:
    shape = tuple(getattr(avals[0], "shape", ()))
    axes = params.get("axes", ())
    kept = int(np.prod([d for i, d in enumerate(shape) if i not in axes]))
    return 16 * kept <= int(np.prod(shape))
  return False


def recomputed(spec: SiteSpec, f):
  """``f`` under ``jax.checkpoint`` as ``spec`` recomputes it (``f`` itself if it does not),
  keeping the masks and statistics (`save_masks_and_statistics`) when it recomputes from a
  compressed input."""
  if not spec.recompute:
    return f
  policy = spec.checkpoint_policy
  if spec.keeps_exact:
    keep = jax.checkpoint_policies.save_from_both_policies(
        save_masks_and_statistics,
        jax.checkpoint_policies.save_only_these_names(EXACT_RESIDUAL))
    policy = (keep if policy is None else
              jax.checkpoint_policies.save_from_both_policies(policy, keep))
  return jax.checkpoint(f, policy=policy, prevent_cse=True)


def site_transform(spec: SiteSpec, key=None, *, missing_key=None):
  """``pure -> g`` for a block site: ``g(variables, rngs, *arrays)`` as ``pure``, whose
  residuals are kept as ``spec`` says (arguments 0 and 1, the site's variables and RNG
  keys, are never compressed or moved: they are alive anyway). ``key``: the stochastic
  rounding's; ``missing_key``: `jmem.ops.actnn.compress`'s hook where it is None."""
  def transform(pure):
    f = recomputed(spec, pure)
    if spec.bits is not None:
      return functools.partial(
          q.compress(f, bits=spec.bits, group_size=spec.group_size, param_argnums=(0, 1),
                     offload=spec.offload, implementation=spec.implementation,
                     arguments_only=spec.keeps_exact, missing_key=missing_key),
          key=key)
    if spec.offload:
      return q.offload_residuals(f, param_argnums=(0, 1))
    return f
  return transform


@dataclasses.dataclass(frozen=True)
class Policy(Technique):
  """One memory policy (`POLICY_KINDS`, module docstring) on the sites ``where=`` selects.

  ``Policy("recompute_compressed", bits=2)`` recomputes every block from a 2-bit copy of its
  input; ``Policy("offload", where=r"stage1_.*")`` keeps stage 1's residuals in host
  memory. Default sites (``where=None``): the direct children of the top module except its
  ``nn.Dense`` / ``nnx.Linear`` layers, as `jmem.Remat`'s.

  Args:
    kind: one of `POLICY_KINDS`.
    bits: bits per stored value (1, 2, 4, 8): required by (and defaulting to 2 for)
      ``compress`` and ``recompute_compressed``; optional for ``offload`` (compress, then
      offload); not taken by ``save`` and ``recompute``.
    group_size: quantization group size (with ``bits``).
    checkpoint_policy: a ``jax.checkpoint_policies`` entry for the recomputing kinds (what
      the recomputation may keep; None: nothing).
    implementation: the quantizer's backend (``"xla"``, ``"pallas"``, None: automatic).
    keep_masks_and_statistics: ``recompute_compressed`` only: the recomputation also
      keeps, exactly, the masks and batch statistics of the forward pass
      (`save_masks_and_statistics`; masks at 1 bit per value), and only the site's input is
      quantized. Without them a value near 0 flips its ReLU mask (the gradient's error then
      grows like the square root of the quantization step: on a third-party ResNet at 8
      bits, 6.3x the error of compressing every residual with `jmem.ActNN`, against 1x with
      them) and recomputed statistics are biased (at 2 bits the mean gradient over 64 keys
      was 7 standard errors from the exact one, against 1 with them).
  """

  kind: str = "recompute"
  bits: int | None = None
  group_size: int = 256
  checkpoint_policy: Any = None
  implementation: str | None = None
  keep_masks_and_statistics: bool = True

  @property
  def compacts_between_sites(self) -> bool:
    # The kinds that store through a custom VJP (compressed or offloaded) also give ReLUs
    # and max pools outside every site an exact 1-bit mask or uint8 index
    # (`jmem.ops.actnn.between`, custom VJPs too); "save" and "recompute" keep the model
    # differentiable in forward mode (jax.jvp), as jax.checkpoint does.
    return self.kind in ("compress", "recompute_compressed", "offload")

  def __post_init__(self):
    super().__post_init__()
    if self.kind not in POLICY_KINDS:
      raise ValueError(f"Policy kind {self.kind!r} is not one of {', '.join(POLICY_KINDS)}.")
    if self.bits is None and self.kind in _WITH_BITS:
      object.__setattr__(self, "bits", 2)
    if self.bits is not None:
      if self.kind not in _WITH_BITS + ("offload",):
        raise ValueError(f"Policy({self.kind!r}) keeps full precision and takes no bits "
                         f"(got bits={self.bits}); use 'compress' or 'recompute_compressed'.")
      if isinstance(self.bits, bool) or not isinstance(self.bits, int):
        raise TypeError(f"Policy(bits=...) must be an int, got {self.bits!r}.")
      q.check_config(self.bits, self.group_size)
    if self.bits is None and (self.group_size != 256 or self.implementation is not None):
      raise ValueError(f"Policy({self.kind!r}) quantizes nothing, so group_size and "
                       "implementation apply only with bits (compress, recompute_compressed, "
                       "offload with bits=).")
    if not self.keep_masks_and_statistics and self.kind != "recompute_compressed":
      raise ValueError("keep_masks_and_statistics is an option of 'recompute_compressed' only.")
    if self.checkpoint_policy is not None and not callable(self.checkpoint_policy):
      raise TypeError("checkpoint_policy takes a jax.checkpoint_policies entry (a callable, "
                      f"e.g. jax.checkpoint_policies.dots_saveable), got "
                      f"{self.checkpoint_policy!r}.")
    if self.checkpoint_policy is not None and "recompute" not in self.kind:
      raise ValueError(f"Policy({self.kind!r}) recomputes nothing, so it takes no "
                       "checkpoint_policy; use 'recompute' or 'recompute_compressed'.")
    check_implementation(self.implementation, q.OPS, "Policy")

  def spec(self) -> SiteSpec:
    return SiteSpec(recompute=self.kind.startswith("recompute"),
                    checkpoint_policy=self.checkpoint_policy, bits=self.bits,
                    group_size=self.group_size, offload=self.kind == "offload",
                    implementation=self.implementation,
                    keep_masks_and_statistics=self.keep_masks_and_statistics)
