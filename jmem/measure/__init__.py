"""Measurement harness: saved-activation bytes, compiled memory on a target device,
collectives, the largest batch, step time.

Every technique in jmem is judged by these functions, always against an exact baseline
measured in the same run. All memory figures are compile-only, so they work for models that
are far too large to run on the machine doing the measuring: pass
`jax.ShapeDtypeStruct`s instead of arrays. They are for a `Target` (`target`): JAX's default
backend, or a GPU compiled for without one (``target("h100")``: XLA:GPU's own buffer
assignment, on a CPU machine).

The modules, by concern: `jmem.measure.targets` (targets), ``_compiled`` (compiled memory
and FLOPs, `jit`), ``_residuals`` (what the backward pass keeps, traced), ``_heap``
(XLA's buffer assignment read buffer by buffer), ``_fit`` (memory against the batch, the
largest batch, step times), ``_hlo_traffic`` and ``_step_time`` (the bytes a compiled
module's kernels move, and a GPU step time estimated from them).
"""

from jmem.measure._compiled import CompiledMemory as CompiledMemory
from jmem.measure._compiled import compiled_memory as compiled_memory
from jmem.measure._compiled import device_bytes_and_flops as device_bytes_and_flops
from jmem.measure._compiled import jit as jit
from jmem.measure._compiled import lowered_flops as lowered_flops
from jmem.measure._compiled import platform_of as platform_of
from jmem.measure._compiled import platform_of_args as platform_of_args
from jmem.measure._compiled import step_flops as step_flops
from jmem.measure._compiled import xla_compiler_options as xla_compiler_options
from jmem.measure._fit import GIB as GIB
from jmem.measure._fit import BatchFit as BatchFit
from jmem.measure._fit import fit_batch as fit_batch
from jmem.measure._fit import fit_step as fit_step
from jmem.measure._fit import time_steps as time_steps
from jmem.measure._heap import COLLECTIVE_OPS as COLLECTIVE_OPS
from jmem.measure._heap import DumpUnavailableError as DumpUnavailableError
from jmem.measure._heap import HeapBuffer as HeapBuffer
from jmem.measure._heap import HeapLayout as HeapLayout
from jmem.measure._heap import PeakBuffer as PeakBuffer
from jmem.measure._heap import PeakReport as PeakReport
from jmem.measure._heap import collective_counts as collective_counts
from jmem.measure._heap import heap_layout as heap_layout
from jmem.measure._heap import peak_buffers as peak_buffers
from jmem.measure._hlo_traffic import Traffic as Traffic
from jmem.measure._hlo_traffic import shape_bytes as shape_bytes
from jmem.measure._hlo_traffic import traffic as traffic
from jmem.measure._residuals import VIEW_PRIMITIVES as VIEW_PRIMITIVES
from jmem.measure._residuals import Residual as Residual
from jmem.measure._residuals import ResidualReport as ResidualReport
from jmem.measure._residuals import module_path as module_path
from jmem.measure._residuals import saved_residuals as saved_residuals
from jmem.measure._step_time import COPY_RATE as COPY_RATE
from jmem.measure._step_time import MATMUL_RATE as MATMUL_RATE
from jmem.measure._step_time import StepTime as StepTime
from jmem.measure._step_time import constants_for as constants_for
from jmem.measure._step_time import estimate_step_time as estimate_step_time
from jmem.measure.targets import PINNED_JAXLIB as PINNED_JAXLIB
from jmem.measure.targets import TARGETS as TARGETS
from jmem.measure.targets import Target as Target
from jmem.measure.targets import TargetError as TargetError
from jmem.measure.targets import TargetFallbackWarning as TargetFallbackWarning
from jmem.measure.targets import target as target

__all__ = [
    "VIEW_PRIMITIVES", "jit", "xla_compiler_options", "Residual", "ResidualReport",
    "CompiledMemory", "saved_residuals", "compiled_memory", "BatchFit", "fit_batch",
    "fit_step", "device_bytes_and_flops", "step_flops", "lowered_flops", "platform_of",
    "platform_of_args", "module_path", "PeakBuffer", "PeakReport", "peak_buffers",
    "HeapBuffer", "HeapLayout", "heap_layout", "DumpUnavailableError", "collective_counts",
    "time_steps", "COLLECTIVE_OPS", "GIB", "Target", "TargetError", "TargetFallbackWarning",
    "TARGETS", "target", "PINNED_JAXLIB", "Traffic", "traffic", "shape_bytes", "StepTime",
    "estimate_step_time", "constants_for", "COPY_RATE", "MATMUL_RATE",
]
