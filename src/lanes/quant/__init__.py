"""Quantized weights on the CPU: GGUF block formats kept as they are in the file, multiplied by C++ kernels."""

from .build import from_gguf, quantized
from .formats import FORMATS, BlockFormat, block_format
from .native import KernelsUnavailable, unavailable_reason
from .weight import DenseWeight, QuantWeight, StackedWeight, Weight, stack_rows

__all__ = [
    "FORMATS", "BlockFormat", "DenseWeight", "KernelsUnavailable", "QuantWeight", "StackedWeight", "Weight",
    "block_format", "from_gguf", "quantized", "stack_rows", "unavailable_reason",
]
