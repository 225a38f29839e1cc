"""Stochastic Backpropagation: the forward on every node, the backward on a sampled subset.

* `jmem.ops.sbp.core` (re-exported here): ``sbp``, ``sbp_rows`` and their references, the
  samplers.
* `jmem.ops.sbp.technique`: the ``sbp-<ratio>`` bench names (jmem's video models).
"""

from jmem.ops.sbp.core import SAMPLERS as SAMPLERS
from jmem.ops.sbp.core import Sampler as Sampler
from jmem.ops.sbp.core import sbp as sbp
from jmem.ops.sbp.core import sbp_reference as sbp_reference
from jmem.ops.sbp.core import sbp_rows as sbp_rows
from jmem.ops.sbp.core import sbp_rows_reference as sbp_rows_reference
from jmem.ops.sbp.core import num_kept as num_kept
from jmem.ops.sbp.core import sample_indices as sample_indices
from jmem.ops.sbp.core import checkerboard as checkerboard
from jmem.ops.sbp.core import get_sampler as get_sampler
from jmem.ops.sbp.core import check_keep_ratio as check_keep_ratio
from jmem.ops.sbp.technique import SBP as SBP
