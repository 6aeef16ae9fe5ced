"""Next tokens for one pass, on the device: penalties, filters and seeded draws, batched; prompt logprobs.

The parameters are the lane core's plain data (`lanes.core.sampling`); these functions run them on logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..core.grammar import Masks
from ..core.sampling import RowSampling, SamplingParams
from ..quant.native import available
from .penalties import PenaltyState, penalise

NEG_INF = float("-inf")

# splitmix64 (Steele, Lea and Flood; Vigna's splitmix64.c): the increment and the two finalizer multipliers.
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


@dataclass(frozen=True)
class Sampled:
    """A pass's draws, on the device. Logprobs are of the model's raw distribution (log_softmax of the
    unprocessed logits); K is the largest `top_logprobs` over the rows (0 when none asks)."""

    tokens: Tensor  # [R] int64
    logprobs: Tensor  # [R] float32
    top_ids: Tensor  # [R, K] int64
    top_logprobs: Tensor  # [R, K] float32


@dataclass(frozen=True)
class HostSampled:
    """A pass's draws on the host; `top[r]` holds row r's first `top_logprobs` alternatives, best first."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def process(logits: Tensor, rows: Sequence[RowSampling], penalties: PenaltyState | None = None,
            before: Sequence[tuple[int, ...]] | None = None, masks: Masks | None = None) -> Tensor:
    """The logits each row draws from: [R, V] any float dtype -> [R, V] float32, -inf where masked.

    In vLLM's order: logit_bias, the min_tokens mask and a grammar's mask on the raw logits, then (as transformers orders
    them) repetition penalty on prompt and output tokens, presence and frequency penalties on output
    counts, temperature, top_k, top_p, min_p. Greedy rows get the bias, mask and penalties only (no
    temperature, no filters): the sampler takes their argmax.
    """
    scores = logits.float()
    if len(rows) != scores.shape[0]:
        raise ValueError(f"{len(rows)} rows for {scores.shape[0]} logits rows")
    scores = penalise(_masked(_adjust(scores, rows), masks), rows, penalties, before)
    vocab, device = scores.shape[1], scores.device
    # Neutral values where a filter is off, so one batched op serves every row.
    floats = [(1.0, -1.0, 0.0) if row.params.greedy else _warp(row.params) for row in rows]
    top_k = [vocab if row.params.greedy or row.params.top_k == 0 else min(row.params.top_k, vocab) for row in rows]
    table = torch.tensor(floats, dtype=torch.float32, device=device).reshape(len(rows), 3)
    temperature, top_p_floor, min_p = table[:, 0:1], table[:, 1:2], table[:, 2:3]  # each [R, 1] float32
    scores = scores / temperature
    if any(k < vocab for k in top_k) or any(f[1] >= 0 for f in floats):
        kth_from_end = torch.tensor(top_k, dtype=torch.int64, device=device)[:, None]  # [R, 1]
        scores = _top_k_top_p(scores, vocab - kth_from_end, top_p_floor)
    if any(f[2] > 0 for f in floats):
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)
    return scores


def _adjust(scores: Tensor, rows: Sequence[RowSampling]) -> Tensor:
    """scores: [R, V] float32 -> a copy with each row's logit_bias added and, while a row has fewer than
    min_tokens tokens out, its stop tokens at -inf; `scores` itself where no row has either."""
    at_rows: list[int] = []
    at_tokens: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        params = row.params
        for token, bias in params.logit_bias:
            at_rows.append(i)
            at_tokens.append(token)
            values.append(bias)
        if row.step < params.min_tokens:
            at_rows.extend([i] * len(params.min_tokens_stops))
            at_tokens.extend(params.min_tokens_stops)
            values.extend([NEG_INF] * len(params.min_tokens_stops))
    if not at_rows:
        return scores
    device = scores.device
    index = (torch.tensor(at_rows, dtype=torch.int64, device=device),  # [N] rows
             torch.tensor(at_tokens, dtype=torch.int64, device=device))  # [N] token ids
    # Out of place: `scores` may be the raw logits, which the logprobs are read from.
    return scores.index_put(index, torch.tensor(values, dtype=torch.float32, device=device), accumulate=True)


def _masked(scores: Tensor, masks: Masks | None) -> Tensor:
    """scores: [R, V] float32 -> a copy with the tokens each masked row's grammar refuses at -inf; `scores`
    itself without masks. The bits come from the host ([G, W] int32, bit t%32 of word t//32 for token t)."""
    if masks is None:
        return scores
    device, vocab = scores.device, scores.shape[1]
    index = torch.tensor(masks.rows, dtype=torch.int64, device=device)  # [G] rows of scores
    if device.type == "cpu":  # numpy's unpack is ~50x the shifts' speed on the host
        unpacked = np.unpackbits(masks.bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(unpacked.view(np.bool_))  # [G, V]
    else:  # the packed words cross to the device (1/8 of the bytes) and unpack there
        bits = torch.from_numpy(masks.bits).to(device)  # [G, W] int32
        shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(masks.rows), -1)[:, :vocab]  # [G, V]
    return scores.index_copy(0, index, scores.index_select(0, index).masked_fill(~allowed, NEG_INF))


def _warp(params: SamplingParams) -> tuple[float, float, float]:
    # 1 - top_p in double, then float32, as transformers compares it; -1 turns top_p off (a cumulative
    # probability of 0 would otherwise drop underflowed tokens, and transformers skips top_p = 1).
    floor = 1.0 - params.top_p if params.top_p < 1 else -1.0
    return (params.temperature, floor, params.min_p)


def _top_k_top_p(scores: Tensor, kth_position: Tensor, top_p_floor: Tensor) -> Tensor:
    """scores: [R, V] float32; kth_position: [R, 1] int64, where the k-th largest sits in ascending order;
    top_p_floor: [R, 1] float32. transformers' TopK then TopP warpers, sharing one sort."""
    ascending, order = scores.sort(dim=-1)  # [R, V] each
    cut = ascending < ascending.gather(1, kth_position)
    # Masked before the softmax, as transformers' top_p sees top_k's output; the order is unchanged.
    cumulative = ascending.masked_fill(cut, NEG_INF).softmax(dim=-1).cumsum(dim=-1)
    cut |= cumulative <= top_p_floor
    cut[:, -1] = False  # the best token always stays
    return scores.masked_fill(cut.scatter(1, order, cut), NEG_INF)


def sample(logits: Tensor, rows: Sequence[RowSampling], penalties: PenaltyState | None = None,
           before: Sequence[tuple[int, ...]] | None = None, masks: Masks | None = None) -> Sampled:
    """Every row's next token. logits: [R, V] any float dtype, on the device; no host sync.

    Greedy rows take the argmax of the penalised logits. Other rows draw by the exponential race over
    `process`'s logits with uniforms hashed from (seed, step, token id), so a seeded stream gets the same
    token in any batch, in any row order, on every call. Non-greedy rows need a seed (`with_seed`).
    """
    raw = logits.float()  # [R, V] float32
    scores = process(raw, rows, penalties, before, masks)
    tokens = scores.argmax(dim=-1)  # [R] int64; greedy rows keep these
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = torch.tensor(drawn, dtype=torch.int64, device=raw.device)  # [S]
        keys = torch.tensor([stream_key(rows[i]) for i in drawn], dtype=torch.int64, device=raw.device)  # [S]
        tokens = tokens.index_copy(0, index, race(scores.index_select(0, index), keys))
    logprobs = log_softmax(raw)  # [R, V] float32
    k = max((row.params.top_logprobs for row in rows), default=0)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return Sampled(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs)


def log_softmax(raw: Tensor) -> Tensor:
    """[R, V] float32 -> its log_softmax over V: on the CPU our kernel (lanes/quant/cpu_softmax.cpp), whose
    values `lanes.gpu.graphs.greedy_draw` shares bit for bit; elsewhere torch's."""
    if raw.device.type == "cpu" and available():
        return torch.ops.lanes_quant.log_softmax(raw)
    return torch.log_softmax(raw, dim=-1)


def stream_key(row: RowSampling) -> int:
    """The row's splitmix64 state, from its seed and step, as a signed int64."""
    if row.params.seed is None:
        raise ValueError(f"lane {row.lane} samples without a seed")
    return _signed(_splitmix64_int(_splitmix64_int(row.params.seed & MASK64) ^ (row.step & MASK64)))


def _splitmix64_int(z: int) -> int:
    """splitmix64's finalizer on a Python int, wrapping at 64 bits as `splitmix64` does on tensors."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def splitmix64(z: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping multiplies; masks make the shifts logical)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(MIX1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(MIX2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def uniforms(keys: Tensor, vocab: int) -> Tensor:
    """keys: [S] int64 -> [S, vocab] float64 in (0, 1): output t+1 of the splitmix64 stream seeded with
    each key for token t, its top 53 bits plus one half, over 2^53."""
    counter = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device) * _signed(GOLDEN)  # [vocab]
    bits = splitmix64(keys[:, None] + counter)  # [S, vocab] int64
    return (((bits >> 11) & ((1 << 53) - 1)).double() + 0.5) * 2.0**-53


def race(scores: Tensor, keys: Tensor) -> Tensor:
    """The exponential race: argmax of p / E with E = -log(u) exponential, i.e. of logits - log(E).
    scores: [S, V] float32, -inf never wins; keys: [S] int64 -> [S] int64 token ids.
    Float64 noise keeps near-ties from depending on how a kernel rounds a row."""
    exponential = -torch.log(uniforms(keys, scores.shape[1]))  # [S, V] float64, > 0
    return (scores.double() - torch.log(exponential)).argmax(dim=-1)


def on_host(sampled: Sampled, rows: Sequence[RowSampling]) -> HostSampled:
    """Draws already copied to the host as plain lists; row r keeps `rows[r].params.top_logprobs` alternatives."""
    ids, values = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
    wanted = [row.params.top_logprobs for row in rows]
    top = [list(zip(ids[i][: wanted[i]], values[i][: wanted[i]])) for i in range(len(rows))]
    return HostSampled(tokens=sampled.tokens.tolist(), logprobs=sampled.logprobs.tolist(), top=top)


def prompt_logprobs(logits: Tensor, targets: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each prompt token's logprob given the rows before it, from the raw distribution.

    logits: [N, V] any float dtype, row i predicting targets[i]; targets: [N] int64 ->
    (logprobs [N] float32, top ids [N, top] int64, top logprobs [N, top] float32).
    """
    logprobs = log_softmax(logits.float())  # [N, V] float32
    values, ids = logprobs.topk(top, dim=-1)
    return logprobs.gather(1, targets[:, None]).squeeze(1), ids, values
