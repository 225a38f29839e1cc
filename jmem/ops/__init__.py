"""Custom-VJP operations that save less for the backward pass."""

from jmem.ops.inplace_abn import InPlaceABN as InPlaceABN
from jmem.ops.inplace_abn import InPlaceABNSync as InPlaceABNSync
from jmem.ops.inplace_abn import NNXInPlaceABN as NNXInPlaceABN
from jmem.ops.inplace_abn import inplace_abn as inplace_abn
from jmem.ops.inplace_abn import inplace_abn_reference as inplace_abn_reference
