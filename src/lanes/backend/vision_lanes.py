"""Each lane's images and videos, as a pass needs them: M-RoPE positions and the vision tower's embeddings.

A stream with media binds its lane here; every pass that carries rows of that lane gets their three
positions (prompt rows from the prompt's layout, later rows at their index plus the lane's offset), and
a pass that carries media rows gets their embeddings, each image or video encoded once, in the first pass
that reaches its rows (on the runner's thread, so the event loop never waits for the tower).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..families.decoder import PassMedia
from ..families.mrope import GridSpan, prompt_positions
from ..core.media import PromptMedia
from ..core.passes import Piece


@dataclass
class LaneVision:
    positions: np.ndarray  # [3, prompt length] int64
    delta: int  # a row past the prompt sits at its index plus this
    media: tuple[PromptMedia, ...]
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)  # media index -> [rows, hidden] on the device


class VisionLanes:
    """Lanes bound with media, for a decoder whose vision tower is `tower` (merge size `merge`)."""

    def __init__(self, tower, merge: int, device: torch.device) -> None:
        self.tower, self.merge, self.device = tower, merge, device
        self._lanes: dict[int, LaneVision] = {}

    def bind(self, lane: int, prompt_length: int, media: Sequence[PromptMedia]) -> None:
        spans = [GridSpan(m.start, m.grid, m.interval) for m in media]
        for m, span in zip(media, spans):
            if span.rows(self.merge) != m.rows:
                raise ValueError(f"a {m.kind} of grid {m.grid} has {span.rows(self.merge)} rows, not {m.rows}")
        positions, delta = prompt_positions(prompt_length, spans, self.merge)
        self._lanes[lane] = LaneVision(positions, delta, tuple(media))

    def unbind(self, lane: int) -> None:
        self._lanes.pop(lane, None)

    def bound(self, lane: int) -> bool:
        return lane in self._lanes

    def offsets(self, pieces: Sequence[Piece]) -> list[int] | None:
        """Each decode row's rotary offset over its index (0 for lanes without media); None when all are 0."""
        if not any(p.lane in self._lanes for p in pieces):
            return None
        return [self._lanes[p.lane].delta if p.lane in self._lanes else 0 for p in pieces]

    def pass_media(self, pieces: Sequence[Piece]) -> PassMedia | None:
        """Positions [3, T] for every row of the pass and the media rows' embeddings; None without media lanes."""
        if not any(p.lane in self._lanes for p in pieces):
            return None
        positions, rows, embeds, offset = [], [], [], 0
        for piece in pieces:
            index = np.arange(piece.start, piece.end, dtype=np.int64)
            lane = self._lanes.get(piece.lane)
            if lane is None:
                positions.append(np.broadcast_to(index, (3, len(index))))
            else:
                length = lane.positions.shape[1]
                inside = index < length
                picked = lane.positions[:, np.minimum(index, length - 1)]
                positions.append(np.where(inside, picked, index + lane.delta))
                for i, item in enumerate(lane.media):
                    first, last = max(item.start, piece.start), min(item.end, piece.end)
                    if first < last:
                        rows.append(np.arange(first, last, dtype=np.int64) - piece.start + offset)
                        embeds.append(self._encoded(lane, i)[first - item.start : last - item.start])
            offset += len(index)
        hidden = self.tower.config.out_hidden_size
        return PassMedia(np.ascontiguousarray(np.concatenate(positions, axis=1)),
                         np.concatenate(rows) if rows else np.zeros(0, np.int64),
                         torch.cat(embeds) if embeds else torch.zeros(0, hidden, device=self.device))

    def _encoded(self, lane: LaneVision, i: int) -> torch.Tensor:
        if i not in lane.encoded:
            item = lane.media[i]
            pixels = item.pixels.to(self.device, non_blocking=True)  # [patches, patch_dim] float32
            lane.encoded[i] = self.tower.encode(pixels, [item.grid])  # [rows, hidden]
        return lane.encoded[i]
