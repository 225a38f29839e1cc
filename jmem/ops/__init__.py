"""Techniques that change what a step saves for its backward pass, one package each:
`jmem.ops.actnn` (2-bit activation compression), `jmem.ops.inplace_abn` (In-Place
Activated BatchNorm), `jmem.ops.sbp` (Stochastic Backpropagation), `jmem.ops.remat`
(``jax.checkpoint``, JAX's own peer). Each package holds its math and ``*_reference``, its
Flax modules and its `jmem.convert` / ``jmem bench`` technique side by side.
"""

from jmem.ops.inplace_abn import InPlaceABN as InPlaceABN
from jmem.ops.inplace_abn import InPlaceABNSync as InPlaceABNSync
from jmem.ops.inplace_abn import NNXInPlaceABN as NNXInPlaceABN
