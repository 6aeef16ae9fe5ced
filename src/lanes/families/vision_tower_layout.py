"""Where a vision tower's patches sit and which of them attend together, built on the host from the grids.

Rows follow the image processor's order: image by image, frame by frame, and within a frame the
`merge x merge` blocks that the patch merger folds into one token, row-major. Attention runs per frame
(Qwen2-VL, and Qwen2.5-VL's full-attention blocks) or per window of `window x window` merged tokens inside a
frame (Qwen2.5-VL's other blocks, on rows permuted so that each window is contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]  # (t, h, w) in patches: frames / temporal patch, rows, columns


@dataclass(frozen=True)
class SegmentGroup:
    """`count` segments of `length` rows each; `rows` ([count * length] int64, on the device) lists them
    segment after segment, or is None when the group is every row in order."""

    length: int
    count: int
    rows: torch.Tensor | None


def segment_groups(lengths: Sequence[int], device: torch.device) -> tuple[SegmentGroup, ...]:
    """Contiguous segments of the given lengths, grouped by length so that each group is one batched SDPA call.

    A block-diagonal mask would cost [N, N] memory and rule out the flash kernels; one call a segment would
    launch hundreds of small kernels a layer for Qwen2.5's windows. Grouping by length needs one call per
    distinct length (a frame size, or a window's four edge cases per image size), with no mask at all. On an
    H200, a 7B-sized Qwen2.5-VL tower in bf16 over one 1344x1344 image took 65 ms grouped, 136 ms with the mask
    and 356 ms with one call a segment.
    """
    lengths = [n for n in lengths if n > 0]
    if len(set(lengths)) == 1:
        return (SegmentGroup(lengths[0], len(lengths), None),)
    starts, offset = [], 0
    for n in lengths:
        starts.append(offset)
        offset += n
    groups = []
    for length in sorted(set(lengths)):
        first = torch.tensor([s for s, n in zip(starts, lengths) if n == length], dtype=torch.int64)
        rows = (first[:, None] + torch.arange(length)).flatten()  # [count * length] int64
        groups.append(SegmentGroup(length, len(first), rows.to(device, non_blocking=True)))
    return tuple(groups)


def frame_lengths(grids: Sequence[Grid]) -> list[int]:
    """Rows of each frame (each temporal patch), image after image."""
    return [h * w for t, h, w in grids for _ in range(t)]


def rotary_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """[N, 2] int64 on the host: each row's (h, w) patch position, in the merge-block order the rows come in."""
    out = []
    for t, h, w in grids:
        hpos = torch.arange(h)[:, None].expand(h, w)
        wpos = torch.arange(w)[None, :].expand(h, w)
        # (h/m, m, w/m, m) -> (h/m, w/m, m, m): each merge block's patches next to each other
        blocks = [p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for p in (hpos, wpos)]
        out.append(torch.stack(blocks, dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (order [N / merge**2] int64 on the host, each window's rows in patches).

    `order[i]` is the merged token that goes i-th when windows are made contiguous; windows run frame by
    frame, row-major over each frame's `window x window` tiles of merged tokens (edge tiles are smaller).
    """
    order, lengths, first = [], [], 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        index = torch.arange(t * mh * mw).reshape(t, mh, mw)
        ph, pw = -mh % window, -mw % window
        padded = F.pad(index, (0, pw, 0, ph), value=-1)
        tiles = padded.reshape(t, (mh + ph) // window, window, (mw + pw) // window, window).permute(0, 1, 3, 2, 4)
        tiles = tiles.reshape(-1, window * window)  # [windows, window**2] merged tokens, -1 for padding
        kept = tiles[tiles >= 0]
        order.append(kept + first)
        lengths.extend((n * merge * merge for n in (tiles >= 0).sum(-1).tolist()))
        first += t * mh * mw
    return torch.cat(order), lengths


@dataclass(frozen=True)
class GridLayout:
    """One `encode` call's layout on the device, shared by every block."""

    cos: torch.Tensor  # [N, head_dim] float32, in the rows' order (window order when windowed)
    sin: torch.Tensor  # [N, head_dim] float32
    frames: tuple[SegmentGroup, ...]
    windows: tuple[SegmentGroup, ...] | None  # None without window attention
    order: torch.Tensor | None  # [N / merge**2] int64: merged tokens in window order
    restore: torch.Tensor | None  # [N / merge**2] int64: back from window order to the processor's

    @classmethod
    def build(
        cls, grids: Sequence[Grid], *, merge: int, head_dim: int, theta: float, window: int, device: torch.device
    ) -> "GridLayout":
        """`window` is in merged tokens; 0 means no window attention (Qwen2-VL)."""
        positions = rotary_positions(grids, merge)  # [N, 2] int64
        order = restore = windows = None
        if window:
            order_cpu, lengths = window_order(grids, merge, window)
            unit = merge * merge
            # cos and sin follow the rows into window order, merge block by merge block
            positions = positions.view(-1, unit, 2)[order_cpu].view(-1, 2)
            order = order_cpu.to(device, non_blocking=True)
            restore = torch.argsort(order_cpu).to(device, non_blocking=True)
            windows = segment_groups(lengths, device)
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))
        angles = positions.to(device, non_blocking=True)[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        angles = angles.flatten(1)  # [N, head_dim / 2]: h's angles, then w's
        angles = torch.cat([angles, angles], dim=-1)  # [N, head_dim]
        frames = segment_groups(frame_lengths(grids), device)
        return cls(cos=angles.cos(), sin=angles.sin(), frames=frames, windows=windows, order=order, restore=restore)
