"""A stream's grammar on the lane core: every token drawn is one its grammar allows, the grammar's end ends
the stream, drafted rows are masked by the grammar state after the draft tokens before them and rejected
tokens roll it back, so a constrained stream gets exactly its solo tokens whatever the drafts.

Rules: the real lane core on the fake backend, with its toy grammar (`fake_grammar`: tokens of one residue,
then EOS) and its FakeDrafter (which knows the fake's unmasked draws, so many drafts break the grammar);
the lane core's books, and the backend's matchers, are checked when each run stops.
"""

import numpy as np
import pytest

from engine_helpers import collect, greedy, running, seeded
from lanes.core.fake import EOS, FakeBackend, FakeDrafter, FakeMatcher, fake_grammar
from lanes.core.grammar import LaneGrammars, allowed
from lanes.core.passes import Piece
from lanes.core.plan import Sampled, Work
from lanes.core.sampling import InvalidParameter, RowSampling, SamplingParams
from lanes.core.stream import Request

VOCAB = 50


async def run(batch, drafts=None, most=4):
    backend = FakeBackend(lanes=4, blocks=64, vocab=VOCAB, max_model_len=512)
    async with running(backend, drafts=drafts, draft_tokens=most, draft_control=False) as core:
        streams = [await core.submit(request) for request in batch]
        outcomes = [await collect(stream) for stream in streams]
    backend.grammars.check_integrity()
    assert not backend.grammars.is_bound(0)
    return outcomes, backend.plans


def constrained() -> list[Request]:
    return [Request((3, 4, 5), greedy(40, grammar=fake_grammar(3, 2, 6))),
            Request(tuple(range(3, 17)), seeded(5, 40, grammar=fake_grammar(7, 0, 9))),
            Request((8, 9), greedy(12)),  # unconstrained beside them
            Request((4, 4), seeded(2, 4, grammar=fake_grammar(5, 3, 30)))]  # cut by its length inside the grammar


async def test_every_token_is_allowed_and_the_grammar_end_ends_the_stream():
    outcomes, plans = await run(constrained())
    first, second, free, cut = outcomes
    assert [t % 3 for t in first.tokens[:-1]] == [2] * 6 and first.tokens[-1] == EOS and first.last.reason == "stop"
    assert [t % 7 for t in second.tokens[:-1]] == [0] * 9 and second.tokens[-1] == EOS
    assert len(cut.tokens) == 4 and all(t % 5 == 3 for t in cut.tokens) and cut.last.reason == "length"
    assert not any(p.plain or p.ahead for p in plans if any(w.sample and w.sample.params.grammar for w in p.work))
    assert free.tokens == (await run([constrained()[2]]))[0][0].tokens


@pytest.mark.parametrize("wrong", [0.0, 0.5, 1.0], ids=["all-right", "some-wrong", "all-wrong"])
@pytest.mark.parametrize("most", [1, 3, 8])
async def test_drafted_constrained_streams_get_exactly_their_solo_tokens(wrong, most):
    batch = constrained()
    solo = [(await run([request]))[0][0] for request in batch]
    together, plans = await run(batch, FakeDrafter(VOCAB, wrong, seed=most), most)
    assert [(o.tokens, o.text, o.last.reason) for o in together] == [(o.tokens, o.text, o.last.reason) for o in solo]
    assert any(w.draft and w.sample.params.grammar for p in plans for w in p.work)


def test_a_drafted_rows_masks_follow_the_draft_and_the_matcher_rolls_back():
    grammars = LaneGrammars(VOCAB, FakeMatcher.of)
    grammars.bind(2, fake_grammar(4, 1, 3))
    params = SamplingParams(temperature=0, grammar=fake_grammar(4, 1, 3))
    # lane 2 drafts 5, 9, 10 (10 breaks the grammar), beside an unconstrained lane 0 of one row
    work = [Work(Piece(0, (7,), 3, (0,)), RowSampling(0, SamplingParams(temperature=0), 0)),
            Work(Piece(2, (6, 5, 9, 10), 3, (1,), "all"), RowSampling(2, params, 0), draft=(5, 9, 10))]
    masks = grammars.masks(work)
    assert masks.rows == (1, 2, 3, 4)
    allowed_at = [set(np.flatnonzero(allowed(bits, VOCAB))) for bits in masks.bits]
    ones = {t for t in range(VOCAB) if t % 4 == 1 and t != EOS}
    assert allowed_at == [ones, ones, ones, set(range(VOCAB))]  # after 5 and 9: one more; after 10 refused: void
    matcher = grammars._matchers[2]  # noqa: SLF001 (the test reads the state it checks)
    assert matcher.taken == [] and not matcher.broken
    grammars.advance(work, [Sampled((3,)), Sampled((5, 9, 13))])
    assert matcher.taken == [5, 9, 13]
    assert set(np.flatnonzero(allowed(grammars.masks(work[:1] + [Work(Piece(2, (13,), 7, (1,)),
                                                                          RowSampling(2, params, 3))]).bits[0], VOCAB))) == {EOS}
    grammars.unbind(2)
    grammars.check_integrity()


def test_a_grammar_refuses_ignore_eos_and_min_tokens_by_name():
    for more, param in (({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")):
        with pytest.raises(InvalidParameter) as refused:
            SamplingParams(grammar=fake_grammar(2, 0, 3), **more).validate()
        assert refused.value.param == param
    assert not SamplingParams(temperature=0, grammar=fake_grammar(2, 0, 3)).plain
