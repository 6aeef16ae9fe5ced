"""Rows of the 32-value formats (Q8_0, Q4_0, Q4_1) repacked planar for the kernels, and back.

A file's row is blocks of [f16 d, (f16 m), quants]; the kernels read [every block's quants, every d,
(every m)], the same bytes reordered, so that 16 scales convert in one instruction. The K-quants keep
the file's layout (their scales are packed inside super-blocks of 256)."""

from __future__ import annotations

import torch

from .formats import BlockFormat

SCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}  # f16 scales at the front of each block


def to_kernel(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[rows, row bytes] uint8 in the file's layout -> the kernels' layout (a new tensor, same size)."""
    head = SCALE_BYTES.get(fmt.name)
    if head is None:
        return raw.contiguous()
    blocks = raw.reshape(raw.shape[0], -1, fmt.bytes)  # [rows, groups, block bytes]
    parts = [blocks[:, :, head:]] + [blocks[:, :, at : at + 2] for at in range(0, head, 2)]
    return torch.cat([p.reshape(raw.shape[0], -1) for p in parts], dim=1).contiguous()


def to_file(packed: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The inverse of `to_kernel`: the file's layout of rows in the kernels' layout."""
    head = SCALE_BYTES.get(fmt.name)
    if head is None:
        return packed.contiguous()
    rows, groups = packed.shape[0], packed.shape[1] // fmt.bytes
    quants = packed[:, : groups * (fmt.bytes - head)].reshape(rows, groups, fmt.bytes - head)
    scales = packed[:, groups * (fmt.bytes - head) :].reshape(rows, head // 2, groups, 2).transpose(1, 2)
    return torch.cat([scales.reshape(rows, groups, head), quants], dim=2).reshape(rows, -1).contiguous()
