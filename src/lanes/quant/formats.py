"""The GGUF block formats the kernels read in place: values and bytes a block, ggml's type numbers."""

from __future__ import annotations

from dataclasses import dataclass

import gguf

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format: `values` weights of a row stored in `bytes` bytes (scales included)."""

    name: str
    kind: int  # ggml's type number, what the kernels dispatch on
    values: int
    bytes: int

    def row_bytes(self, columns: int) -> int:
        """Bytes of one row of `columns` values; ValueError unless the row is whole blocks."""
        if columns <= 0 or columns % self.values:
            raise ValueError(f"{self.name} rows are whole blocks of {self.values} values, not {columns}")
        return columns // self.values * self.bytes


FORMATS: dict[int, BlockFormat] = {
    int(t): BlockFormat(t.name, int(t), *gguf.constants.GGML_QUANT_SIZES[t])
    for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
}
DENSE = {int(Q.F32), int(Q.F16), int(Q.BF16)}  # kept as torch tensors in the activation dtype, as before


def block_format(kind: int | gguf.GGMLQuantizationType) -> BlockFormat | None:
    """The format of a GGUF type the kernels read, or None (dense types and those without a kernel)."""
    return FORMATS.get(int(kind))


def type_name(kind: int | gguf.GGMLQuantizationType) -> str:
    return Q(int(kind)).name
