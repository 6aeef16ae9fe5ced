"""Each bound lane's token history on the device, and the repetition, presence and frequency penalties
that read it (transformers' and OpenAI's formulas), for the rows of a pass that use them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..core.sampling import RowSampling


class PenaltyState:
    """Each bound lane's prompt tokens and output counts, on the device, for the penalties.

    Only lanes whose request `needs_penalties` are bound; the [lanes, vocab] tensors are allocated at the
    first bind, so a server whose requests never use penalties holds none. A lane is bound at most once
    until it is unbound; `bind` starts it afresh. `bind` and `unbind` take effect on the host at once and
    on the device at the next `flush`, which the backend calls at the start of each pass, on that pass's
    stream (and every read of the state makes first): so a lane's state never changes under a pass that is
    still running.
    """

    def __init__(self, lanes: int, vocab: int, device: torch.device | str) -> None:
        self.lanes = lanes
        self.vocab = vocab
        self.device = torch.device(device)
        self._bound: set[int] = set()
        self._prompt: Tensor | None = None  # [lanes, vocab] bool: the token is in the lane's prompt
        self._counts: Tensor | None = None  # [lanes, vocab] int32: times the lane has produced the token
        self._weight: Tensor | None = None  # [lanes] int32: 1 for bound lanes, so `record` skips the others
        self._writes: list[tuple[int, list[int] | None]] = []  # (lane, its prompt's ids, or None to unbind), in order

    @property
    def allocated(self) -> bool:
        return self._counts is not None

    def is_bound(self, lane: int) -> bool:
        return lane in self._bound

    def bind(self, lane: int, prompt_ids: Sequence[int]) -> None:
        """Starts `lane`'s history: output counts zero, prompt mask = the tokens of `prompt_ids`."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane {lane} is outside 0..{self.lanes - 1}")
        if lane in self._bound:
            raise ValueError(f"lane {lane} is already bound")
        # Ids past the logits (a tokenizer smaller than the padded vocabulary) can never be penalised.
        self._writes.append((lane, [token for token in prompt_ids if 0 <= token < self.vocab]))
        self._bound.add(lane)

    def unbind(self, lane: int) -> None:
        if lane not in self._bound:
            raise ValueError(f"lane {lane} is not bound")
        self._bound.discard(lane)
        self._writes.append((lane, None))

    def flush(self) -> None:
        """The device writes of every bind and unbind since the last flush, in order, on the current stream."""
        if not self._writes:
            return
        if self._counts is None:
            self._prompt = torch.zeros(self.lanes, self.vocab, dtype=torch.bool, device=self.device)
            self._counts = torch.zeros(self.lanes, self.vocab, dtype=torch.int32, device=self.device)
            self._weight = torch.zeros(self.lanes, dtype=torch.int32, device=self.device)
        for lane, ids in self._writes:
            if ids is None:
                self._weight[lane] = 0
                continue
            self._prompt[lane] = False
            self._counts[lane] = 0
            if ids:
                self._prompt[lane, torch.tensor(ids, dtype=torch.int64, device=self.device)] = True
            self._weight[lane] = 1
        self._writes.clear()

    def record(self, lanes: Tensor, tokens: Tensor) -> None:
        """Adds each token to its lane's output counts, on the device without a host sync; lanes that
        are not bound are skipped. lanes, tokens: [R] int64 on the state's device."""
        self.flush()
        if self._counts is None:
            return
        self._counts.index_put_((lanes, tokens), self._weight[lanes], accumulate=True)

    def counts(self, lanes: Tensor) -> Tensor:
        """lanes: [P] int64 -> [P, vocab] int32, how often each lane has produced each token."""
        self.flush()
        if self._counts is None:
            raise ValueError("no lane has been bound")
        return self._counts.index_select(0, lanes)

    def prompt_mask(self, lanes: Tensor) -> Tensor:
        """lanes: [P] int64 -> [P, vocab] bool, the tokens in each lane's prompt."""
        self.flush()
        if self._prompt is None:
            raise ValueError("no lane has been bound")
        return self._prompt.index_select(0, lanes)

    def check_integrity(self) -> None:
        """Raises AssertionError unless the device flags match the bound set and no count is negative
        (once the writes still pending are made)."""
        self.flush()
        if self._counts is None:
            assert not self._bound, "lanes bound without allocated state"
            return
        flagged = set(self._weight.nonzero().flatten().tolist())
        assert flagged == self._bound, f"device flags {sorted(flagged)} != bound lanes {sorted(self._bound)}"
        assert bool((self._counts >= 0).all()), "a negative output count"


def penalise(scores: Tensor, rows: Sequence[RowSampling], penalties: PenaltyState | None,
             before: Sequence[tuple[int, ...]] | None = None) -> Tensor:
    """scores: [R, V] float32 -> the same with the penalties of the rows that use them. `before[r]`: tokens
    row r's lane has produced in this pass before it (a draft's, ahead of its later rows), counted too."""
    picked = [i for i, row in enumerate(rows) if row.params.needs_penalties]
    if not picked:
        return scores
    for i in picked:
        if penalties is None or not penalties.is_bound(rows[i].lane):
            raise ValueError(f"lane {rows[i].lane} uses penalties but is not bound")
    device = scores.device
    index = torch.tensor(picked, dtype=torch.int64, device=device)  # [P]
    lanes = torch.tensor([rows[i].lane for i in picked], dtype=torch.int64, device=device)  # [P]
    params = [rows[i].params for i in picked]
    values = [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params]
    table = torch.tensor(values, dtype=torch.float32, device=device)  # [P, 3]
    repetition, frequency, presence = table[:, 0:1], table[:, 1:2], table[:, 2:3]  # each [P, 1]
    counts = penalties.counts(lanes)  # [P, V] int32
    if before is not None and any(before[i] for i in picked):
        at = [(j, token) for j, i in enumerate(picked) for token in before[i]]
        rows_at = torch.tensor([j for j, _ in at], dtype=torch.int64, device=device)
        tokens_at = torch.tensor([t for _, t in at], dtype=torch.int64, device=device)
        counts = counts.index_put((rows_at, tokens_at), torch.ones_like(rows_at, dtype=counts.dtype), accumulate=True)
    produced = counts > 0
    sub = scores.index_select(0, index)  # [P, V] float32
    # transformers' RepetitionPenaltyLogitsProcessor: shrink positive logits, push negative ones down.
    penalised = torch.where(sub < 0, sub * repetition, sub / repetition)
    sub = torch.where(penalties.prompt_mask(lanes) | produced, penalised, sub)
    # OpenAI's formula: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence.
    sub = sub - counts.float() * frequency - produced.float() * presence
    return scores.index_copy(0, index, sub)
