"""logit_bias and min_tokens in the sampler: what they do to the logits, and the draws made from them.

Rules: CPU only, small vocabularies. References nobody here wrote: transformers' SequenceBiasLogitsProcessor
(single-token biases) and MinNewTokensLengthLogitsProcessor (stop ids masked below a count of new tokens),
composed in vLLM's order: the bias and the mask on the raw logits, then the penalties and warpers, as
`transformers_row` in test_sampling applies those. Logprobs stay those of the raw logits.
"""

from __future__ import annotations

import pytest
import torch
from test_sampling import VOCAB, bound_state, random_logits, seeded, transformers_row
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor

from lanes.core.sampling import RowSampling, SamplingParams, plain_greedy

from lanes.backend.draws import process, sample

BIAS = ((3, 5.5), (17, -100.0), (40, 100.0), (63, -2.25))
# (params, prompt, produced tokens) per row; lanes are the row numbers.
BIASED = [
    (SamplingParams(temperature=0.0, logit_bias=BIAS), [], []),
    (SamplingParams(temperature=0.7, top_k=5, seed=1, logit_bias=((1, 3.0), (2, -3.0))), [], []),
    (SamplingParams(temperature=1.3, top_p=0.8, seed=2), [], []),
    (SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, seed=4, logit_bias=BIAS),
     [1, 2, 3, 40], [40, 9, 9]),
    (SamplingParams(temperature=0.0, repetition_penalty=1.2, logit_bias=((8, 2.0),)), [8], [8]),
]


def with_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [1, V] through transformers' sequence bias, one single-token sequence a bias."""
    if not params.logit_bias:
        return logits
    processor = SequenceBiasLogitsProcessor([[[token], bias] for token, bias in params.logit_bias])
    return processor(torch.zeros(1, 1, dtype=torch.int64), logits)


@pytest.mark.parametrize("seed", range(4))
def test_biased_rows_equal_transformers_sequence_bias_then_the_processors(seed):
    rows, state = bound_state(BIASED)
    logits = random_logits(len(BIASED), seed=seed)
    processed = process(logits, rows, state)
    expected = torch.cat([transformers_row(with_bias(logits[i : i + 1].clone(), p), p, prompt + out)
                          for i, (p, prompt, out) in enumerate(BIASED)])
    assert torch.equal(processed, expected)
    assert processed[0, 17] == logits[0, 17] - 100 and processed[0, 40] == logits[0, 40] + 100  # in float32
    assert torch.equal(processed[2], process(logits[2:3], rows[2:3], None)[0])  # an unbiased row beside them is untouched


def test_a_bias_moves_the_greedy_argmax_and_the_seeded_draw_but_not_the_logprobs():
    logits = random_logits(3, seed=9, scale=1.0)
    natural = logits[0].argmax().item()
    pushed = (natural + 1) % VOCAB
    bias = ((natural, -100.0), (pushed, 100.0))
    rows = [RowSampling(0, SamplingParams(temperature=0.0, logit_bias=bias), 0),
            seeded(SamplingParams(temperature=1.0, logit_bias=bias), seed=5),
            seeded(SamplingParams(temperature=1.0, logit_bias=((7, 4.0),)), seed=6, step=3)]
    drawn = sample(logits, rows)
    assert drawn.tokens.tolist()[:2] == [pushed, pushed]
    # The same draw as from logits that carry the bias themselves, under the same key.
    shifted = logits[2:3].clone()
    shifted[0, 7] += 4.0
    assert drawn.tokens[2].item() == sample(shifted, [seeded(SamplingParams(temperature=1.0), seed=6, step=3)]).tokens.item()
    raw = torch.log_softmax(logits, dim=-1)  # within 1e-6: the CPU kernels' exp and order of sums are their own
    torch.testing.assert_close(drawn.logprobs, raw[torch.arange(3), drawn.tokens], rtol=1e-6, atol=1e-6)
    assert not plain_greedy(rows[:1])


@pytest.mark.parametrize("step", range(5))
def test_min_tokens_masks_the_stop_ids_while_fewer_tokens_are_out(step):
    params = [SamplingParams(temperature=0.0, min_tokens=3, min_tokens_stops=(2, 50)),
              SamplingParams(temperature=0.8, seed=3, min_tokens=4, min_tokens_stops=(7,), logit_bias=((7, 9.0), (8, 1.0)))]
    rows = [RowSampling(lane, p, step) for lane, p in enumerate(params)]
    logits = random_logits(2, seed=step)
    processed = process(logits, rows)
    history = torch.zeros(1, step, dtype=torch.int64)  # only the count of new tokens matters here
    for r, p in enumerate(params):
        masked = MinNewTokensLengthLogitsProcessor(0, p.min_tokens, list(p.min_tokens_stops))(history, with_bias(logits[r : r + 1].clone(), p))
        assert torch.equal(processed[r : r + 1], transformers_row(masked, p, []))
    assert torch.isinf(processed[0, [2, 50]]).all() == (step < 3)
    assert torch.isinf(processed[1, 7]).item() == (step < 4)
    if step < 3:
        assert sample(logits[:1].clone().index_fill_(1, torch.tensor([2]), 1e4), rows[:1]).tokens.item() != 2
