"""ActNN as a technique: the `jmem.convert` object (`ActNN`) and the ``jmem bench`` names
``actnn-L1`` .. ``actnn-L5`` (L3-L5 calibrated on a training batch)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmem import step as step_lib
from jmem._backends import check_implementation
from jmem._technique import BenchTechnique, Technique
from jmem.ops.actnn import levels
from jmem.ops.actnn import quantize

__all__ = ["ActNN", "calibration_problem", "calibration_problem_on", "CALIBRATION_BATCH",
           "CALIBRATION_VALUES", "BENCH_TECHNIQUES"]


@dataclasses.dataclass(frozen=True)
class ActNN(Technique):
  """ActNN / GACT activation compression (`jmem.ops.actnn`) at ``level``.

  ``ActNN("L3")`` (the default), ``ActNN(bits=2)`` (L3 at ``bits``), or a
  `jmem.ops.actnn.Level` (e.g. from `jmem.ops.actnn.calibrate`). L1/L2 sites default to
  every convolution (and, at L2, BatchNorm-like module); L3-L5 sites (whole blocks: every
  floating residual inside is compressed) default to the direct children of the top module
  except its ``nn.Dense`` / ``nnx.Linear`` layers (a head, an embedding: one matmul, little
  to save; name them in ``where=`` to include them), as `Remat`'s. L0 changes nothing.
  Per-site bits of a calibrated level are keyed by the site's path. ReLUs and max pools
  outside every site (inline in a module's ``__call__``) keep an exact 1-bit mask or uint8
  index instead of their float input (`jmem.ops.actnn.between`; not at L0). The rounding key comes
  from the RNG stream ``"actnn"``: ``apply(..., rngs=jmem.rngs(key))`` in linen, ``with
  jmem.rngs(key):`` in either API. Differentiated without it, a site raises ValueError
  (inference needs no key); inside ``jmem.surgery.data_keys()`` it draws one from the data.
  """

  level: Any = "L3"
  bits: int | None = None
  implementation: str | None = None
  # Set by `jmem.surgery.calibrate` only: the sites then probe gradient sensitivity.
  probe: Any = dataclasses.field(default=None, repr=False, compare=False)

  def __post_init__(self):
    super().__post_init__()
    check_implementation(self.implementation, quantize.OPS, "ActNN")
    lv = self.resolved_level()
    if self.where is not None and lv.block_bits is None and lv.conv_bits is None and \
        lv.norm_bits is None:
      raise ValueError(f"ActNN level {lv.name} compresses nothing, so where={self.where!r} "
                       "would select sites for nothing; drop where= (or pick L1-L5).")

  @property
  def compacts_between_sites(self) -> bool:
    lv = self.resolved_level()
    return not (lv.block_bits is None and lv.conv_bits is None and lv.norm_bits is None)

  def resolved_level(self) -> levels.Level:
    lv = levels.get_level(self.level)
    if self.bits is not None:
      if isinstance(self.bits, bool) or not isinstance(self.bits, int):
        raise TypeError(f"ActNN(bits=...) must be an int, got {self.bits!r}.")
      if lv.block_bits is None:
        raise ValueError(f"ActNN(bits={self.bits}) sets the bits of block sites; level "
                         f"{lv.name} has none (use L3-L5).")
      lv = dataclasses.replace(lv, name=f"{lv.name}@{self.bits}b", block_bits=self.bits)
    return lv


# ------------------------------------------------------------------- jmem bench

CALIBRATION_BATCH = 16          # examples, at most
CALIBRATION_VALUES = 16 * 256   # input values, at most (fewer examples for large images)


def calibration_problem(model, dataset, batch_size: int):
  """``(params, loss_fn, batch)`` on which the ``actnn-L3``..``L5`` techniques calibrate
  their bits (`jmem.surgery.calibrate`): the initial weights (seed 0) and the first
  training examples, at most `CALIBRATION_BATCH` and at most `CALIBRATION_VALUES` input
  values (but 2 examples at least); ``loss_fn`` is the training loss of `jmem.step`."""
  return calibration_problem_on(model, dataset.x_train[:batch_size],
                                dataset.y_train[:batch_size])


def calibration_problem_on(model, x, y, *, max_values: int = CALIBRATION_VALUES,
                           loss_fn=None):
  """`calibration_problem` on the examples ``x``, ``y`` (arrays; the first of them, as many
  as `calibration_problem` takes, or up to ``max_values`` input values), the loss the
  mean of ``loss_fn`` (`jmem.step.make_loss`; default: cross-entropy)."""
  per_example = int(np.prod(np.shape(x)[1:]))
  n = min(len(x), max(2, min(CALIBRATION_BATCH, max_values // max(per_example, 1))))
  x, y = jnp.asarray(x[:n]), jnp.asarray(y[:n])
  params, state = step_lib.model_fns(model).init(jax.random.key(0), x[:1])

  def probe_loss(module, p, batch):
    loss = step_lib.make_loss(step_lib.model_fns(module), loss_fn)
    return loss(p, state, *batch, jax.random.key(1))[0]
  return params, probe_loss, (x, y)


def _convert(level: str):
  return lambda implementation: ActNN(level, implementation=implementation)


_WHAT = (("L1", "4-bit conv inputs"), ("L2", "4-bit conv + BatchNorm"),
         ("L3", "residuals of every default site at 2 bits on average, per-site bits "
                "from gradient sensitivity"),
         ("L4", "L3 offloaded to pinned host memory"),
         ("L5", "L4 with 1024-value groups (less metadata)"))

# L3-L5 are calibrated by the bench (`jmem.surgery.calibrate` on `calibration_problem`).
BENCH_TECHNIQUES = tuple(
    BenchTechnique(f"actnn-{lv}", _convert(lv), f"ActNN {lv}: {what}",
                   calibrate=lv in ("L3", "L4", "L5"), has_kernels=True,
                   kernel_ops=quantize.OPS)
    for lv, what in _WHAT)
