"""M-RoPE (Qwen2-VL): three positions a row (time, height, width) instead of one.

Text rows have all three equal; an image's or a video's rows take their place in the merged patch grid,
offset by the text before them, and the text after them resumes past the grid. Each rotary pair is
driven by one of the three positions, by `mrope_section`. A row whose three positions are equal rotates
exactly as plain RoPE does at that position, so decode rows need only a per-stream offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class GridSpan:
    """One image's or video's placeholder rows in a prompt: `rows` tokens from `start`, laid out on `grid`
    (t, h, w in patches, before the merge) with `interval` positions between temporal patches."""

    start: int
    grid: tuple[int, int, int]
    interval: float = 1.0

    def rows(self, merge: int) -> int:
        t, h, w = self.grid
        return t * (h // merge) * (w // merge)


def prompt_positions(length: int, spans: Sequence[GridSpan], merge: int) -> tuple[np.ndarray, int]:
    """Positions [3, length] int64 for a prompt whose vision rows are `spans` (in order), and the offset
    (delta) that every later row's position has over its index; the rule of transformers' get_rope_index."""
    out = np.empty((3, length), dtype=np.int64)
    at, position = 0, 0  # the next prompt row, and the next text position
    for span in spans:
        text = span.start - at
        out[:, at : span.start] = np.arange(position, position + text)
        position += text
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        times = (np.arange(t) * span.interval).astype(np.int64) + position
        grid = np.stack(np.meshgrid(times, np.arange(h) + position, np.arange(w) + position, indexing="ij")).reshape(3, -1)
        out[:, span.start : span.start + grid.shape[1]] = grid
        at = span.start + grid.shape[1]
        position += max(h, w)  # as transformers advances past a grid (its time extent is not counted)
    out[:, at:] = np.arange(position, position + length - at)
    delta = int(out.max()) + 1 - length if length else 0
    return out, delta


def mrope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, section: Sequence[int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions [3, T]: pair i takes its frequency from the position that
    its section names (t, h, w, t, ...), computed in float32 and cast as transformers does."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [3, T, D/2]
    picked = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(list(section), dim=-1))], dim=-1)  # [T, D/2]
    emb = torch.cat((picked, picked), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
