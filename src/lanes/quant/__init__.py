"""Quantized weights on the CPU: GGUF block formats kept as they are in the file, multiplied by C++ kernels."""

from .build import from_gguf, quantized
from .quantize import SCHEMES
from .census import Census, census
from .formats import FORMATS, BlockFormat, block_format
from .native import KernelsUnavailable, unavailable_reason
from .weight import DenseWeight, QuantWeight, StackedWeight, Weight, pad_rows, stack_rows

__all__ = [
    "SCHEMES", "Census", "census", "FORMATS", "BlockFormat", "DenseWeight", "KernelsUnavailable", "QuantWeight", "StackedWeight", "Weight",
    "block_format", "from_gguf", "pad_rows", "quantized", "stack_rows", "unavailable_reason",
]
