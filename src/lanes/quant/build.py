"""Weights built from what a checkpoint holds: a GGUF tensor's raw bytes and type, or a full-precision
tensor quantized for `--quantize int8|int4`."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from .formats import FORMATS, type_name
from .native import unavailable_reason
from .quantize import SCHEMES, quantize_rows
from .weight import DenseWeight, QuantWeight, Weight


def from_gguf(data: np.ndarray, kind: int | gguf.GGMLQuantizationType, shape: tuple[int, int], dtype: torch.dtype,
              *, device: torch.device | str | None = None, keep: bool = True) -> Weight:
    """A GGUF matrix of torch shape [out, in] from its bytes as the reader maps them (`data`), for `device`
    (None: the CPU).

    On the CPU, types with a kernel stay in their format (the bytes copied once, nothing dequantized);
    F32/F16/BF16 become a tensor in `dtype`; other types, or any type when the kernels cannot run here, are
    dequantized to `dtype` on the device, as is every type without `keep`. On CUDA the kernels are
    lanes.gpu.quant's (Q8_0, Q4_K, Q6_K)."""
    out_features, in_features = shape
    fmt = FORMATS.get(int(kind))
    device = torch.device(device or "cpu")
    if keep and device.type == "cuda":
        from ..gpu.quant import KINDS, CudaQuantWeight

        if fmt is not None and fmt.kind in KINDS:
            raw = np.ascontiguousarray(data).view(np.uint8).reshape(out_features, fmt.row_bytes(in_features))
            return CudaQuantWeight(torch.from_numpy(raw.copy()).to(device), fmt, shape)
    elif keep and fmt is not None and device.type == "cpu" and unavailable_reason() is None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(out_features, fmt.row_bytes(in_features))
        return QuantWeight(torch.from_numpy(raw.copy()), fmt, shape)
    values = np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(int(kind)))).reshape(shape)
    tensor = torch.from_numpy(np.array(values, copy=True)).to(device=device, dtype=dtype)
    return DenseWeight(tensor, type_name(kind))


def quantized(tensor: torch.Tensor, scheme: str) -> Weight:
    """`--quantize int8` (Q8_0: int8, one f16 scale a 32) or `int4` (Q4_1: 4 bits, f16 scale and minimum
    a 32) of an [out, in] tensor; the tensor itself when the kernels cannot run here."""
    fmt = FORMATS[int(SCHEMES[scheme])]
    if unavailable_reason() is not None:
        return DenseWeight(tensor)
    return QuantWeight(quantize_rows(tensor, SCHEMES[scheme]), fmt, (int(tensor.shape[0]), int(tensor.shape[1])))
