"""Rows of the 32-value formats (Q8_0, Q4_0, Q4_1) in the integer kernels' layout, and back.

A file's row is blocks of [f16 d, (f16 m), 32 quants]; the integer kernels (int8_kernels.cpp) read
[every quant in their lane order, every d, (every m)]: the same bytes, the quants reordered so that each
vpdpbusd lane sums 4 values of one group (int8_chunks.h says the order), and Q8_0's int8 quants stored as
unsigned (q + 128), the operand vpdpbusd takes unsigned."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .formats import BlockFormat

SCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}  # f16 scales at the front of each block
ROWS_AT_ONCE = 4096  # rows reordered together: bounds the temporary copy of their values


@functools.cache
def lane_order(groups: int) -> np.ndarray:
    """For each byte of a row's instruction stream, the index (32 g + v) of the value it holds."""
    order = []
    first = 0
    size = 16
    while size >= 1:
        if groups - first < size:
            size //= 2
            continue
        lanes = 8 if size == 1 else 16 // size
        stream = np.full((max(1, size // 2), 64), -1, dtype=np.int64)
        for i in range(size):
            for u in range(8):
                lane = i * lanes + u % lanes
                stream[u // lanes, 4 * lane : 4 * lane + 4] = 32 * (first + i) + 4 * u + np.arange(4)
        order.append(stream.reshape(-1)[: 32 * size])  # a chunk of one group is 32 bytes
        first += size
        if size < 16:
            size //= 2
    return np.concatenate(order)


@functools.cache
def nibble_order(groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For each packed byte of a 4-bit row, the value indices of its low and high nibble."""
    order = lane_order(groups)
    lows, highs = [], []
    at, first, size = 0, 0, 16
    while size >= 1:
        if groups - first < size:
            size //= 2
            continue
        half = min(64, 16 * size)
        units = order[at : at + 32 * size].reshape(-1, 2, half)
        lows.append(units[:, 0].reshape(-1))
        highs.append(units[:, 1].reshape(-1))
        at += 32 * size
        first += size
        if size < 16:
            size //= 2
    return np.concatenate(lows), np.concatenate(highs)


def to_lanes(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[rows, row bytes] uint8 in the file's layout -> the integer kernels' layout (a new tensor, same size)."""
    rows, groups = raw.shape[0], raw.shape[1] // fmt.bytes
    out = torch.empty_like(raw)
    for r0 in range(0, rows, ROWS_AT_ONCE):
        blocks = raw[r0 : r0 + ROWS_AT_ONCE].numpy().reshape(-1, groups, fmt.bytes)
        out[r0 : r0 + ROWS_AT_ONCE] = torch.from_numpy(_pack(blocks, fmt))
    return out


def from_lanes(packed: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The inverse of `to_lanes`: the file's layout of rows in the integer kernels' layout."""
    rows, groups = packed.shape[0], packed.shape[1] // fmt.bytes
    head = SCALE_BYTES[fmt.name]
    quant_bytes = groups * (fmt.bytes - head)
    out = np.empty((rows, groups, fmt.bytes), dtype=np.uint8)
    data = packed.numpy()
    values = np.empty((rows, 32 * groups), dtype=np.uint8)
    if fmt.name == "Q8_0":
        values[:, lane_order(groups)] = data[:, :quant_bytes] ^ 0x80
        out[:, :, head:] = values.reshape(rows, groups, 32)
    else:
        low, high = nibble_order(groups)
        values[:, low] = data[:, :quant_bytes] & 0x0F
        values[:, high] = data[:, :quant_bytes] >> 4
        v = values.reshape(rows, groups, 32)
        out[:, :, head:] = v[:, :, :16] | (v[:, :, 16:] << 4)
    scales = data[:, quant_bytes:].reshape(rows, head // 2, groups, 2).transpose(0, 2, 1, 3)
    out[:, :, :head] = scales.reshape(rows, groups, head)
    return torch.from_numpy(out.reshape(rows, -1))


def _pack(blocks: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """[rows, groups, block bytes] of the file -> [rows, row bytes] of the kernels."""
    rows, groups = blocks.shape[:2]
    head = SCALE_BYTES[fmt.name]
    quants = blocks[:, :, head:]
    if fmt.name == "Q8_0":
        stream = quants.reshape(rows, -1)[:, lane_order(groups)] ^ 0x80
    else:  # a block's byte j holds value j (low nibble) and value j + 16 (high nibble)
        values = np.concatenate([quants & 0x0F, quants >> 4], axis=2).reshape(rows, -1)
        low, high = nibble_order(groups)
        stream = values[:, low] | (values[:, high] << 4)
    scales = [blocks[:, :, at : at + 2].reshape(rows, -1) for at in range(0, head, 2)]
    return np.ascontiguousarray(np.concatenate([stream, *scales], axis=1))
