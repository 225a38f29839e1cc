"""Pallas GPU kernels of jmem (Triton backend), each beside the XLA path it replaces.

The kernels are registered as the ``"pallas"`` backend of their ops in `jmem._backends` and
reached through ``implementation=`` of the jmem ops; on a machine without
a GPU they run in interpret mode (with a warning) or can be lowered for CUDA inside
`lowering_for_gpu`.
"""

from pallas_kernels._interpret import compiled_kernels as compiled_kernels
from pallas_kernels._interpret import lowering_for_gpu as lowering_for_gpu
from pallas_kernels._interpret import resolve_interpret as resolve_interpret
from jmem._backends import targets_gpu as targets_gpu
