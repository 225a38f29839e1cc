"""In-Place Activated BatchNorm: BatchNorm + an invertible activation whose backward starts
from the output, so that only the output is saved.

* `jmem.ops.inplace_abn.core` (re-exported here): ``inplace_abn`` and its reference, the
  linen modules `InPlaceABN` / `InPlaceABNSync` and NNX's `NNXInPlaceABN`, the scale
  mapping; the statistics come from the BatchNorm core shared with SyncBN
  (`jmem._bn_core`), the kernels from `pallas_kernels.inplace_abn`.
* `jmem.ops.inplace_abn.technique`: `jmem.InPlaceABN` for `jmem.convert` (a technique
  object, not the module of the same name here), and the ``inplace-abn`` bench name.
"""

from jmem.ops.inplace_abn.core import ACTIVATIONS as ACTIVATIONS
from jmem.ops.inplace_abn.core import ABNConfig as ABNConfig
from jmem.ops.inplace_abn.core import inplace_abn as inplace_abn
from jmem.ops.inplace_abn.core import inplace_abn_reference as inplace_abn_reference
from jmem.ops.inplace_abn.core import to_batch_norm_scale as to_batch_norm_scale
from jmem.ops.inplace_abn.core import from_batch_norm_scale as from_batch_norm_scale
from jmem.ops.inplace_abn.core import InPlaceABN as InPlaceABN
from jmem.ops.inplace_abn.core import InPlaceABNSync as InPlaceABNSync
from jmem.ops.inplace_abn.core import NNXInPlaceABN as NNXInPlaceABN
