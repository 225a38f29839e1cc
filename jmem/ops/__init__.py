"""Custom-VJP operations that save less for the backward pass.

Functions live in their modules (``jmem.ops.inplace_abn.inplace_abn``, also ``jmem.inplace_abn``);
the module names are not shadowed here.
"""

from jmem.ops.inplace_abn import InPlaceABN as InPlaceABN
from jmem.ops.inplace_abn import InPlaceABNSync as InPlaceABNSync
from jmem.ops.inplace_abn import NNXInPlaceABN as NNXInPlaceABN
