"""ActNN / GACT activation compression: residuals saved at 1-8 bits per value, quantized per
group with stochastic rounding and packed.

* `jmem.ops.actnn.quantize`: the quantizer (``quantize``/``dequantize``, bit packing,
  ``compress``: any function's residuals compressed), with its Pallas kernels
  (`pallas_kernels.quantize`) behind ``implementation=``.
* `jmem.ops.actnn.compressed_ops`: single compressed operations, each beside its
  ``*_reference``.
* `jmem.ops.actnn.levels` (re-exported here): the levels L0-L5, ``compressed`` blocks, the
  sensitivities and bit allocation behind `jmem.surgery.calibrate`. A model gets a level
  with ``jmem.convert(model, jmem.ActNN(level))``.
* `jmem.ops.actnn.technique`: `jmem.ActNN` for `jmem.convert`, and the ``actnn-L*`` bench
  names.
"""

from jmem.ops.actnn import compressed_ops as compressed_ops
from jmem.ops.actnn import quantize as quantize
from jmem.ops.actnn.levels import Level as Level
from jmem.ops.actnn.levels import LEVELS as LEVELS
from jmem.ops.actnn.levels import get_level as get_level
from jmem.ops.actnn.levels import compressed as compressed
from jmem.ops.actnn.levels import CompressedNNX as CompressedNNX
from jmem.ops.actnn.levels import sensitivities as sensitivities
from jmem.ops.actnn.levels import allocate_bits as allocate_bits
from jmem.ops.actnn.levels import gradient_noise as gradient_noise
from jmem.ops.actnn.technique import ActNN as ActNN
