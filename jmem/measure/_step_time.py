"""A step-time estimate for a GPU target, from its compiled module (no GPU needed).

FLOPs alone miss what a memory-saving technique costs on a GPU: ActNN's quantization adds
3% of a ResNet-50 step's FLOPs but 13-39% of its time on an H100, because it is bandwidth,
not arithmetic. The estimate charges both, and the launches:

    seconds = a * bytes / COPY_RATE + b * flops / MATMUL_RATE[dtype] + c * kernels * 1e-6

``bytes``: what the optimised module's kernels read and write (`traffic`); ``flops``: the
lowered module's (the compiled GPU module counts a cuDNN call as none); ``dtype``: what its
convolutions and matrix products run in. ``a``, ``b``, ``c`` were fitted on the H100's
measured step times of five float32 ResNet-50 steps, and checked on held-out ones
(``benchmarks/step_time.py``, ``benchmarks/results/step_time.md``).
"""

from __future__ import annotations

import dataclasses

from jmem.measure._hlo_traffic import Traffic, traffic

__all__ = ["StepTime", "estimate_step_time", "columns", "constants_for", "COPY_RATE",
           "MATMUL_RATE", "CONSTANT_NAMES", "H100_CONSTANTS", "FITTED"]

# The H100's measured device-to-device copy rate (bytes/s), and its dense tensor-core
# rates (FLOP/s): TF32 for float32 steps (XLA's default precision on a GPU), bf16.
COPY_RATE = 3.0e12
MATMUL_RATE = {"f32": 494.7e12, "bf16": 989.4e12, "f16": 989.4e12}
CONSTANT_NAMES = ("a_bytes", "b_flops", "c_launch_us")
# Fitted by `python benchmarks/step_time.py --fit` on the H100's times of 2026-11-27
# (benchmarks/results/step_time.md: every held-out ratio, bf16, third-party and the video
# ViT's, within 0.05; tests/test_step_time.py checks them).
H100_CONSTANTS = (1.0810053, 0.9333346, 4.4278821)
# Targets (`jmem.measure.target` names) with fitted constants.
FITTED = {"h100": H100_CONSTANTS}


def constants_for(target_name: str) -> tuple[float, float, float] | None:
  """The fitted constants of a target (`FITTED`), or None where none were fitted."""
  return FITTED.get(target_name)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """An estimated step time and what it is made of.

  Attributes:
    seconds: the estimate.
    memory_seconds, matmul_seconds, launch_seconds: its three terms.
    traffic: the module's `Traffic` (bytes, kernels).
    flops: the FLOPs charged at the matrix rate.
    dtype: the rate's element type.
  """

  seconds: float
  memory_seconds: float
  matmul_seconds: float
  launch_seconds: float
  traffic: Traffic
  flops: float
  dtype: str


def columns(bytes_moved: float, flops: float, kernels: int, dtype: str | None):
  """The three terms before their fitted constants (seconds at the nominal rates)."""
  rate = MATMUL_RATE.get(dtype or "f32", MATMUL_RATE["f32"])
  return (bytes_moved / COPY_RATE, flops / rate, kernels * 1e-6)


def estimate_step_time(compiled, flops: float, *, dtype: str | None = None,
                       constants=None) -> StepTime:
  """The estimated step time of ``compiled`` (a ``jax.stages.Compiled`` for a GPU target,
  e.g. `jmem.measure.target("h100").compile(step, ...)`) doing ``flops`` (its lowered
  module's, `jmem.measure.lowered_flops`). ``dtype``: what the step computes in
  (``"float32"``, ``"bfloat16"``; the rate its FLOPs are charged at), by default the element
  type of its cuDNN / cuBLAS calls (float32 where it makes none, e.g. a model whose matrix
  products XLA fuses into Triton kernels: give it). ``constants``: ``(a, b, c)``, by
  default the H100's fit."""
  if flops is None:
    raise ValueError("estimate_step_time needs the lowered module's FLOPs "
                     "(jmem.measure.lowered_flops(lowered)); got None.")
  constants = H100_CONSTANTS if constants is None else tuple(constants)
  if len(constants) != len(CONSTANT_NAMES):
    raise ValueError(f"constants are {CONSTANT_NAMES}, got {constants!r}.")
  t = traffic(compiled.as_text())
  rate_dtype = _SHORT.get(str(dtype), dtype) if dtype is not None else t.library_dtype
  if rate_dtype is not None and rate_dtype not in MATMUL_RATE:
    raise ValueError(f"No matrix rate for dtype {dtype!r}: one of float32, bfloat16, "
                     "float16.")
  terms = [k * c for k, c in zip(constants, columns(t.bytes, flops, t.kernels, rate_dtype))]
  return StepTime(seconds=sum(terms), memory_seconds=terms[0], matmul_seconds=terms[1],
                  launch_seconds=terms[2], traffic=t, flops=float(flops),
                  dtype=rate_dtype or "f32")


_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
