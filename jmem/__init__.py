"""jmem: memory-saving training techniques for JAX/Flax, each with its cost measured."""

from jmem import distributed as distributed
from jmem.measure import CompiledMemory as CompiledMemory
from jmem.measure import ResidualReport as ResidualReport
from jmem.measure import collective_counts as collective_counts
from jmem.measure import compiled_memory as compiled_memory
from jmem.measure import jit as jit
from jmem.measure import saved_residuals as saved_residuals
from jmem.measure import time_steps as time_steps
from jmem.measure import xla_compiler_options as xla_compiler_options

from jmem.ops.inplace_abn import inplace_abn as inplace_abn
from jmem.surgery import ActNN as ActNN
from jmem.surgery import InPlaceABN as InPlaceABN
from jmem.surgery import Policy as Policy
from jmem.surgery import Remat as Remat
from jmem.surgery import SBP as SBP
from jmem.surgery import Spatial as Spatial
from jmem.surgery import SyncBN as SyncBN
from jmem.surgery import Technique as Technique
from jmem.surgery import batch_mask as batch_mask
from jmem.surgery import rngs as rngs
from jmem.surgery import convert as convert
from jmem.surgery import technique as technique
from jmem.parallel.sync_bn import sync_batch_norm as sync_batch_norm
from jmem.planner import Plan as Plan
from jmem.planner import plan as plan
from jmem.step import train_step as train_step

__version__ = "0.1.0"

# The submodules `import jmem` does not load itself, loaded on first use (PEP 562):
# ``jmem.models.create_model(...)`` after a bare ``import jmem`` raised AttributeError.
_LAZY = frozenset({"bench", "cli", "data", "measure", "models", "ops", "parallel", "planner",
                   "step", "surgery", "techniques", "tour", "train"})


def __getattr__(name):
  if name in _LAZY:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"jmem.{name}")
  raise AttributeError(f"module 'jmem' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | _LAZY)
