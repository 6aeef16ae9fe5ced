"""Batched sampling: processed logits, seeded draws, logprobs, penalty state and parameter checks.

Rules: CPU only, small vocabularies, no torch.Generator in the code under test. References nobody here
wrote: transformers' logits processors (applied one row at a time, in generate's order), OpenAI's
presence/frequency formula written out token by token, torch's own log_softmax/topk/argmax, and the
published splitmix64 outputs. Seeded draws are deterministic, so the chi-square checks are exact
pass/fail checks against a bound stated beside them, never flaky.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from lanes.backend.draws import GOLDEN, Sampled, on_host, prompt_logprobs, process, sample, splitmix64, uniforms
from lanes.gpu.transfer import to_host
from lanes.backend.penalties import PenaltyState
from lanes.core.sampling import InvalidParameter, RowSampling, SamplingParams, plain_greedy
from lanes.gpu.graphs import greedy_draw

VOCAB = 64
# (params, prompt, produced tokens) per row; lanes are the row numbers.
MIXED = [
    (SamplingParams(temperature=0.7, top_k=5, seed=1), [], []),
    (SamplingParams(temperature=1.3, top_p=0.8, seed=2), [], []),
    (SamplingParams(temperature=1.0, min_p=0.1, seed=3), [], []),
    (SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.3, seed=4), [1, 2, 3, 9], [9, 40, 40]),
    (SamplingParams(seed=5), [], []),
    (SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=0.8, seed=6), [0, 5, 63], [5, 7]),
    (SamplingParams(temperature=1.7, top_k=3, min_p=0.3, seed=7), [], []),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), [4, 8, 15, 16, 23, 42], [42]),
]


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * scale


def bound_state(table) -> tuple[list[RowSampling], PenaltyState]:
    """Rows for `table`, with the penalty rows' prompts bound and produced tokens recorded."""
    state = PenaltyState(len(table), VOCAB, "cpu")
    rows = []
    for lane, (params, prompt, produced) in enumerate(table):
        if params.needs_penalties:
            state.bind(lane, prompt)
            state.record(torch.full((len(produced),), lane), torch.tensor(produced, dtype=torch.int64))
        rows.append(RowSampling(lane=lane, params=params, step=len(produced)))
    return rows, state


def transformers_row(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """One row through transformers' processors in generate's order; logits: [1, V] float32."""
    ids = torch.tensor([history], dtype=torch.int64)
    if params.repetition_penalty != 1:
        logits = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(ids, logits)
    if params.greedy:
        return logits
    logits = TemperatureLogitsWarper(float(params.temperature))(ids, logits)
    if params.top_k:
        logits = TopKLogitsWarper(params.top_k)(ids, logits)
    if params.top_p < 1:
        logits = TopPLogitsWarper(params.top_p)(ids, logits)
    if params.min_p > 0:
        logits = MinPLogitsWarper(params.min_p)(ids, logits)
    return logits


@pytest.mark.parametrize("seed", range(6))
def test_process_equals_transformers_processors_row_by_row(seed):
    rows, state = bound_state(MIXED)
    logits = random_logits(len(MIXED), seed=seed)
    processed = process(logits, rows, state)
    expected = torch.cat(
        [transformers_row(logits[i : i + 1].clone(), p, prompt + out) for i, (p, prompt, out) in enumerate(MIXED)]
    )
    assert processed.dtype == torch.float32
    assert torch.equal(torch.isinf(processed), torch.isinf(expected))
    assert torch.equal(processed, expected)
    kept = torch.isfinite(processed).sum(dim=1).tolist()
    assert kept[0] == 5 and kept[6] <= 3 and kept[4] == VOCAB and kept[7] == VOCAB


def test_presence_and_frequency_follow_openai_formula():
    table = [
        (SamplingParams(presence_penalty=1.5, seed=1), [3, 4], [3, 3, 7]),
        (SamplingParams(frequency_penalty=0.75, seed=2), [], [1, 1, 1, 2]),
        (SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.25, seed=3), [9], [9, 10, 10, 63]),
        (SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.1, seed=4), [5], [5, 6, 6]),
    ]
    rows, state = bound_state(table)
    logits = random_logits(len(table), seed=7, scale=1.0)
    processed = process(logits, rows, state)
    for r, (params, prompt, produced) in enumerate(table):
        history = torch.tensor([prompt + produced])
        row = logits[r : r + 1].clone()
        if params.repetition_penalty != 1:
            row = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(history, row)
        # https://platform.openai.com/docs/advanced-usage/parameter-details, "Frequency and presence penalties":
        # mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        for j in range(VOCAB):
            c = produced.count(j)
            mu = row[0, j].item() - c * params.frequency_penalty - float(c > 0) * params.presence_penalty
            # float32 against double: a few ulps of values below 10 in magnitude.
            assert processed[r, j].item() == pytest.approx(mu, abs=2e-6), (r, j)


def test_greedy_rows_take_the_argmax_of_the_penalised_logits():
    table = [
        (SamplingParams(temperature=0.0), [], []),
        (SamplingParams(temperature=0.8, top_k=1), [], []),
        (SamplingParams(temperature=0.0, repetition_penalty=3.0), [], [0]),
    ]
    rows, state = bound_state(table)
    logits = random_logits(3, seed=3)
    logits[2, 0] = logits[2].max() + 1.0  # the raw argmax, pushed below another token by the penalty
    sampled = sample(logits, rows, state)
    penalised = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([[0]]), logits[2:3].clone())
    expected = [logits[0].argmax().item(), logits[1].argmax().item(), penalised.argmax().item()]
    assert sampled.tokens.tolist() == expected
    assert expected[2] != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_greedy_draw_is_bit_for_bit_what_sample_draws_for_plain_greedy_rows(dtype):
    rows = [RowSampling(i, SamplingParams(temperature=0.0, logprobs=i % 2 == 0), i) for i in range(5)]
    rows.append(RowSampling(5, SamplingParams(temperature=0.9, top_k=1, seed=3), 0))  # top_k 1 is greedy too
    assert plain_greedy(rows)
    logits = random_logits(6, seed=11).to(dtype)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: both take the first index
    drawn, sampled = greedy_draw(logits), sample(logits, rows)
    assert drawn.dtype == torch.float64 and drawn.shape == (2, 6)
    assert drawn[0].long().tolist() == sampled.tokens.tolist() and sampled.tokens[1].item() == 7
    assert torch.equal(drawn[1].float(), sampled.logprobs)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0, top_logprobs=2, logprobs=True),
                                    SamplingParams(temperature=0.0, presence_penalty=0.5),
                                    SamplingParams(temperature=0.0, logit_bias=((3, 0.0),)),
                                    SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4)])
def test_rows_that_sample_report_alternatives_use_penalties_bias_or_min_tokens_are_not_plain(params):
    assert not plain_greedy([RowSampling(0, SamplingParams(temperature=0.0), 0), RowSampling(1, params, 0)])


def test_the_hash_is_splitmix64():
    # Vigna's splitmix64.c seeded with 0 (https://prng.di.unimi.it/splitmix64.c), its first four outputs.
    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]
    states = torch.arange(1, 5, dtype=torch.int64) * (GOLDEN - (1 << 64))
    assert [value & ((1 << 64) - 1) for value in splitmix64(states).tolist()] == published
    expected = [((value >> 11) + 0.5) * 2.0**-53 for value in published]
    assert uniforms(torch.tensor([0]), 4).tolist() == [expected]


def seeded(params: SamplingParams, seed: int, step: int = 0, lane: int = 0) -> RowSampling:
    return RowSampling(lane=lane, params=params.with_seed(seed), step=step)


def test_seeded_draws_repeat_across_calls_batches_and_row_orders():
    logits = random_logits(6, vocab=1000, seed=11, scale=0.5)
    params = [SamplingParams(temperature=t, top_p=p) for t, p in [(1.0, 1.0), (0.7, 0.95), (1.5, 0.9)] * 2]
    rows = [seeded(p, seed=100 + i, step=i, lane=i) for i, p in enumerate(params)]
    together = sample(logits, rows, None).tokens.tolist()
    assert sample(logits, rows, None).tokens.tolist() == together
    alone = [sample(logits[i : i + 1], rows[i : i + 1], None).tokens.item() for i in range(6)]
    assert alone == together
    order = [4, 0, 5, 2, 1, 3]
    extra = random_logits(3, vocab=1000, seed=12)
    mixed_logits = torch.cat([logits[order], extra])
    mixed_rows = [rows[i] for i in order] + [seeded(SamplingParams(), seed=s, lane=9) for s in range(3)]
    shuffled = sample(mixed_logits, mixed_rows, None).tokens.tolist()
    assert shuffled[:6] == [together[i] for i in order]


def test_different_seeds_and_steps_draw_differently():
    flat = torch.zeros(32, 1000)
    by_seed = sample(flat, [seeded(SamplingParams(), seed=s) for s in range(32)], None).tokens.tolist()
    by_step = sample(flat, [seeded(SamplingParams(), seed=5, step=t) for t in range(32)], None).tokens.tolist()
    # 32 uniform draws from 1000 repeat a value with probability ~0.39, so allow a few repeats.
    assert len(set(by_seed)) >= 29 and len(set(by_step)) >= 29
    assert by_seed != by_step


# Upper 0.999 quantiles of the chi-square distribution (scipy.stats.chi2.ppf(0.999, dof)).
CHI2_999 = {2: 13.816, 3: 16.266, 4: 18.467}


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the drawn tokens against `probs` over its nonzero entries, and its dof."""
    n = len(tokens)
    support = [j for j in range(len(probs)) if probs[j] > 0]
    assert set(tokens) <= set(support)
    stat = sum((tokens.count(j) - n * probs[j].item()) ** 2 / (n * probs[j].item()) for j in support)
    return stat, len(support) - 1


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, top_k=3), SamplingParams(temperature=1.0, min_p=0.2)],
)
def test_draws_follow_the_processed_distribution(params):
    # 4000 draws, expected counts >= ~100 per token: the chi-square approximation holds, and a sampler
    # off by 10% in one token's probability would exceed the bound with near certainty.
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.5]])
    probs = torch.softmax(process(logits, [seeded(params, 0)], None)[0].double(), dim=0)
    if not params.top_k and not params.min_p:
        assert torch.allclose(probs, torch.softmax(logits[0].double() / params.temperature, dim=0))
    n = 4000
    batch = logits.expand(n, 5)
    over_seeds = sample(batch, [seeded(params, seed=s) for s in range(n)], None).tokens.tolist()
    over_steps = sample(batch, [seeded(params, seed=77, step=t) for t in range(n)], None).tokens.tolist()
    for tokens in (over_seeds, over_steps):
        stat, dof = chi_square(tokens, probs)
        assert stat < CHI2_999[dof], (stat, dof)


def test_masked_tokens_are_never_drawn():
    logits = random_logits(1, vocab=50, seed=5, scale=1.0)
    for params in [SamplingParams(top_k=4), SamplingParams(top_p=0.5), SamplingParams(min_p=0.2, temperature=2.0)]:
        allowed = torch.isfinite(process(logits, [seeded(params, 0)], None)[0]).nonzero().flatten().tolist()
        assert 2 <= len(allowed) < 50
        rows = [seeded(params, seed=s) for s in range(600)]
        drawn = set(sample(logits.expand(600, 50), rows, None).tokens.tolist())
        assert drawn <= set(allowed)
        assert len(drawn) > 1


def close(values: torch.Tensor, reference: torch.Tensor) -> None:
    torch.testing.assert_close(values, reference, rtol=1e-6, atol=1e-6)


def test_logprobs_are_the_raw_log_softmax_and_its_topk():
    rows, state = bound_state(MIXED)
    for i in (0, 3, 5):
        rows[i] = RowSampling(rows[i].lane, SamplingParams(**{**vars(rows[i].params), "logprobs": True, "top_logprobs": 2 * i + 1}), 0)
    logits = random_logits(len(MIXED), seed=2).to(torch.bfloat16)
    sampled = sample(logits, rows, state)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert sampled.logprobs.dtype == torch.float32 and sampled.top_ids.dtype == torch.int64
    # the CPU kernels' exp and order of sums are their own (16 lanes on AVX2 too): torch's values within 1e-6
    close(sampled.logprobs, reference.gather(1, sampled.tokens[:, None]).squeeze(1))
    values, ids = torch.topk(reference, 11, dim=-1)
    assert torch.equal(sampled.top_ids, ids)
    close(sampled.top_logprobs, values)
    host = on_host(Sampled(*to_host([sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs])), rows)
    assert host.tokens == sampled.tokens.tolist()
    assert host.logprobs == sampled.logprobs.tolist()
    assert [len(t) for t in host.top] == [1, 0, 0, 7, 0, 11, 0, 0]
    assert host.top[3] == list(zip(ids[3, :7].tolist(), values[3, :7].tolist()))


def test_the_read_back_without_top_logprobs_and_an_odd_count():
    rows = [seeded(SamplingParams(), seed=s) for s in range(3)]
    sampled = sample(random_logits(3), rows, None)
    assert tuple(sampled.top_ids.shape) == (3, 0)
    host = on_host(Sampled(*to_host([sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs])), rows)
    assert host.tokens == sampled.tokens.tolist()
    assert host.logprobs == sampled.logprobs.tolist()
    assert host.top == [[], [], []]


def test_prompt_logprobs_are_the_raw_log_softmax():
    logits = random_logits(7, seed=4).half()
    targets = torch.tensor([3, 0, 63, 5, 5, 17, 2])
    chosen, ids, values = prompt_logprobs(logits, targets, 3)
    reference = torch.log_softmax(logits.float(), dim=-1)
    close(chosen, reference[torch.arange(7), targets])
    top_values, top_ids = reference.topk(3, dim=-1)
    assert torch.equal(ids, top_ids)
    close(values, top_values)


def test_penalty_state_is_allocated_at_the_first_bind():
    state = PenaltyState(4, VOCAB, "cpu")
    state.record(torch.tensor([0]), torch.tensor([1]))
    rows = [seeded(SamplingParams(), seed=1), RowSampling(1, SamplingParams(temperature=0), 0)]
    sample(random_logits(2), rows, state)
    assert not state.allocated
    state.check_integrity()
    state.bind(2, [1, 1, 5])
    assert not state.allocated  # the device writes wait for the next pass's flush, on its stream
    state.flush()
    assert state.allocated
    state.check_integrity()


def test_penalty_state_counts_records_and_bind_resets():
    state = PenaltyState(3, 8, "cpu")
    state.bind(0, [1, 2])
    state.bind(2, [7])
    state.record(torch.tensor([0, 2, 0, 1]), torch.tensor([5, 5, 7, 3]))
    state.record(torch.tensor([0, 0]), torch.tensor([5, 5]))
    counts = state.counts(torch.tensor([0, 1, 2])).tolist()
    assert counts == [[0, 0, 0, 0, 0, 3, 0, 1], [0] * 8, [0, 0, 0, 0, 0, 1, 0, 0]]  # lane 1 is not bound
    assert state.prompt_mask(torch.tensor([0, 2])).int().tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 1]]
    with pytest.raises(ValueError, match="lane 0 is already bound"):
        state.bind(0, [])
    state.unbind(0)
    with pytest.raises(ValueError, match="lane 0 is not bound"):
        state.unbind(0)
    state.record(torch.tensor([0]), torch.tensor([4]))
    state.bind(0, [3, 99])  # 99 lies past the vocabulary: no token to penalise
    assert state.counts(torch.tensor([0])).tolist() == [[0] * 8]
    assert state.prompt_mask(torch.tensor([0])).int().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0]]
    state.check_integrity()


def test_rows_that_need_state_or_a_seed_are_refused_without_them():
    with pytest.raises(ValueError, match="lane 0 uses penalties but is not bound"):
        process(random_logits(1), [seeded(SamplingParams(presence_penalty=1.0), 0)], PenaltyState(1, VOCAB, "cpu"))
    with pytest.raises(ValueError, match="lane 3 samples without a seed"):
        sample(random_logits(1), [RowSampling(3, SamplingParams(), 0)], None)


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"temperature": -0.1}, "temperature", "temperature must be between 0 and 2"),
        ({"temperature": 2.5}, "temperature", "temperature must be between 0 and 2"),
        ({"temperature": math.nan}, "temperature", "temperature must be between 0 and 2"),
        ({"top_p": 0.0}, "top_p", "top_p must be greater than 0 and at most 1"),
        ({"top_p": 1.01}, "top_p", "top_p must be greater than 0 and at most 1"),
        ({"top_k": -1}, "top_k", "top_k must be 0 (off) or a positive integer"),
        ({"min_p": -0.01}, "min_p", "min_p must be between 0 and 1"),
        ({"min_p": 1.5}, "min_p", "min_p must be between 0 and 1"),
        ({"presence_penalty": -2.1}, "presence_penalty", "presence_penalty must be between -2 and 2"),
        ({"presence_penalty": 2.1}, "presence_penalty", "presence_penalty must be between -2 and 2"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "frequency_penalty must be between -2 and 2"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be between -2 and 2"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be greater than 0"),
        ({"max_tokens": -1}, "max_tokens", "max_tokens must not be negative"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must not be negative"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens", "min_tokens must be at most max_tokens"),
        ({"logit_bias": ((5, 100.5),)}, "logit_bias", "logit_bias values must be between -100 and 100"),
        ({"logit_bias": ((5, -101.0),)}, "logit_bias", "logit_bias values must be between -100 and 100"),
        ({"logit_bias": tuple((t, 1.0) for t in range(301))}, "logit_bias", "logit_bias may hold at most 300 tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be between 0 and 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs must be between 0 and 20"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs requires logprobs to be true"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop", "stop may hold at most 4 strings"),
        ({"stop": ("a", "")}, "stop", "stop strings must not be empty"),
    ],
)
def test_validate_names_the_bad_parameter(change, param, message):
    with pytest.raises(InvalidParameter) as caught:
        SamplingParams(**change).validate()
    assert caught.value.param == param
    assert str(caught.value) == message


def test_validate_accepts_the_edges_of_every_range():
    SamplingParams().validate()
    SamplingParams(
        temperature=2.0, top_p=1.0, top_k=0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
        repetition_penalty=0.01, max_tokens=1, logprobs=True, top_logprobs=20, stop=("a", "b", "c", "d"),
        min_tokens=1, logit_bias=tuple((t, 100.0 if t % 2 else -100.0) for t in range(300)),
    ).validate()
    SamplingParams(max_tokens=0, prompt_logprobs=True).validate()
    SamplingParams(temperature=0.0, top_p=1e-9, logprobs=True, top_logprobs=0).validate()


def test_params_properties():
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=2).greedy
    assert SamplingParams().with_seed(9) == SamplingParams(seed=9)
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=-0.1).needs_penalties
    assert SamplingParams(frequency_penalty=0.2).needs_penalties
