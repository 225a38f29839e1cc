"""SyncBN: BatchNorm statistics over a named mesh axis, exact for masked, unbalanced batches.

* `jmem.parallel.sync_bn.core` (re-exported here): ``sync_batch_norm`` and its reference,
  the linen `SyncBatchNorm` and NNX `NNXSyncBatchNorm` modules, the interceptor and NNX swap;
  the statistics come from the BatchNorm core shared with InPlace-ABN (`jmem._bn_core`).
* `jmem.parallel.sync_bn.technique`: `jmem.SyncBN` for `jmem.convert`.
"""

from jmem.parallel.sync_bn.core import BatchStats as BatchStats
from jmem.parallel.sync_bn.core import Moments as Moments
from jmem.parallel.sync_bn.core import batch_moments as batch_moments
from jmem.parallel.sync_bn.core import batch_stats as batch_stats
from jmem.parallel.sync_bn.core import combine_moments as combine_moments
from jmem.parallel.sync_bn.core import gather_moments as gather_moments
from jmem.parallel.sync_bn.core import merge_moments as merge_moments
from jmem.parallel.sync_bn.core import sync_batch_norm as sync_batch_norm
from jmem.parallel.sync_bn.core import sync_batch_norm_reference as sync_batch_norm_reference
from jmem.parallel.sync_bn.core import update_running_stats as update_running_stats
from jmem.parallel.sync_bn.core import check_axis_name as check_axis_name
from jmem.parallel.sync_bn.core import check_floating as check_floating
from jmem.parallel.sync_bn.core import check_mask as check_mask
from jmem.parallel.sync_bn.core import params_stay_local as params_stay_local
from jmem.parallel.sync_bn.core import varying_axes as varying_axes
from jmem.parallel.sync_bn.core import warn_if_unsynchronised as warn_if_unsynchronised
from jmem.parallel.sync_bn.core import LocalStatisticsWarning as LocalStatisticsWarning
from jmem.parallel.sync_bn.core import SyncBatchNorm as SyncBatchNorm
from jmem.parallel.sync_bn.core import sync_batch_norm_interceptor as sync_batch_norm_interceptor
from jmem.parallel.sync_bn.core import NNXSyncBatchNorm as NNXSyncBatchNorm
from jmem.parallel.sync_bn.core import replace_nnx_modules as replace_nnx_modules
from jmem.parallel.sync_bn.core import swap_nnx_batch_norm as swap_nnx_batch_norm
from jmem.parallel.sync_bn.technique import SyncBN as SyncBN
