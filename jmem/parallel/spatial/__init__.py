"""Spatial parallelism: activations sharded over H and/or W, halos exchanged by ``ppermute``.

* `jmem.parallel.spatial.halo` (re-exported here): the halo plan and exchange,
  ``halo_conv`` (custom VJP) and its reference, pooling, global mean, DropPath.
* `jmem.parallel.spatial.modules` (re-exported here): the `HaloConv` linen module, mesh
  helpers, ``spatial_model_fns`` (a model run under ``shard_map`` by `jmem.train`).
* `jmem.parallel.spatial.sharded`: convolutions of a model under plain ``jit`` with its
  activations sharded over H/W (what `jmem.Spatial` installs).
* `jmem.parallel.spatial.technique`: `jmem.Spatial` for `jmem.convert`, and the
  ``spatial-8`` bench name.
"""

from jmem.parallel.spatial.halo import HaloPlan as HaloPlan
from jmem.parallel.spatial.halo import plan_halo as plan_halo
from jmem.parallel.spatial.halo import plan_split as plan_split
from jmem.parallel.spatial.halo import halo_exchange as halo_exchange
from jmem.parallel.spatial.halo import halo_conv as halo_conv
from jmem.parallel.spatial.halo import halo_conv_reference as halo_conv_reference
from jmem.parallel.spatial.halo import halo_pool as halo_pool
from jmem.parallel.spatial.halo import global_avg_pool as global_avg_pool
from jmem.parallel.spatial.halo import drop_path as drop_path
from jmem.parallel.spatial.modules import HaloConv as HaloConv
from jmem.parallel.spatial.modules import spatial_mesh as spatial_mesh
from jmem.parallel.spatial.modules import activation_spec as activation_spec
from jmem.parallel.spatial.modules import replicated as replicated
from jmem.parallel.spatial.modules import spatial_model_fns as spatial_model_fns
from jmem.parallel.spatial.sharded import SpatialFallbackWarning as SpatialFallbackWarning
from jmem.parallel.spatial.sharded import sharded_conv as sharded_conv
from jmem.parallel.spatial.technique import Spatial as Spatial
