"""Techniques that spread one step over devices, one package each: `jmem.parallel.sync_bn`
(BatchNorm statistics over a mesh axis) and `jmem.parallel.spatial` (activations sharded
over H/W with halo exchange); and `data_parallel`, the batch sharded over a mesh axis (on
one process or several, see `jmem.distributed`)."""

from jmem.parallel.data_parallel import data_parallel as data_parallel
from jmem.parallel.sync_bn import BatchStats as BatchStats
from jmem.parallel.sync_bn import NNXSyncBatchNorm as NNXSyncBatchNorm
from jmem.parallel.sync_bn import SyncBatchNorm as SyncBatchNorm
from jmem.parallel.sync_bn import batch_stats as batch_stats
from jmem.parallel.sync_bn import swap_nnx_batch_norm as swap_nnx_batch_norm
from jmem.parallel.sync_bn import sync_batch_norm as sync_batch_norm
from jmem.parallel.sync_bn import sync_batch_norm_interceptor as sync_batch_norm_interceptor
from jmem.parallel.sync_bn import sync_batch_norm_reference as sync_batch_norm_reference
