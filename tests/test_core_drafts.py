"""A pass that carries several tokens a lane: a drafter proposes tokens after each stream's pending one, the
backend draws at every row and keeps the prefix its draws confirm, and every stream gets exactly its solo
tokens, logprobs and text, whatever share of the drafts is right.

Rules: the real lane core on the fake backend, whose tokens depend on the KV it reads back, with its
FakeDrafter (it knows the fake's draws and makes a seeded share of its tokens wrong); solo runs draft
nothing; the lane core's books are checked when each run stops (`running`).
"""

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import collect, greedy, running, seeded
from lanes.core.fake import FakeBackend, FakeDrafter
from lanes.core.stream import Request

VOCAB = 50


def requests(max_tokens: int = 40, **more) -> list[Request]:
    return [Request(tuple(range(3, 3 + n)), params) for n, params in [
        (5, greedy(max_tokens, ignore_eos=True, **more)), (14, seeded(7, max_tokens, ignore_eos=True, **more)),
        (30, greedy(max_tokens, ignore_eos=True, logprobs=True, top_logprobs=2, **more)),
        (2, seeded(9, max_tokens, **more))]]


async def run(batch: list[Request], drafts=None, most: int = 4, feeds: bool = False):
    backend = FakeBackend(lanes=4, blocks=64, vocab=VOCAB, max_model_len=512, feeds=feeds)
    async with running(backend, drafts=drafts, draft_tokens=most, draft_control=False) as core:
        streams = [await core.submit(request) for request in batch]
        outcomes = [await collect(stream) for stream in streams]
    return outcomes, backend.plans


def seen(outcome) -> tuple:
    return outcome.tokens, outcome.text, outcome.last, [(e.token, e.logprob, e.top) for e in outcome.events
                                                        if hasattr(e, "logprob")]


@pytest.mark.parametrize("feeds", [False, True], ids=["plain", "feeding"])
@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0], ids=["all-right", "some-wrong", "all-wrong"])
@pytest.mark.parametrize("most", [1, 4, 8])
async def test_drafted_streams_get_exactly_their_solo_tokens(wrong, most, feeds):
    batch = requests()
    solo = [(await run([request]))[0][0] for request in batch]
    together, plans = await run(batch, FakeDrafter(VOCAB, wrong, seed=most), most, feeds)
    assert [seen(o) for o in together] == [seen(o) for o in solo]
    drafted = [w for p in plans for w in p.work if w.draft]
    assert drafted and max(len(w.draft) for w in drafted) == most
    rows = sum(len(p.work) - p.prefills for p in plans)  # decode works, each one lane's piece
    after_prompt = [len(o.tokens) - 1 for o in solo]  # each stream's first token comes with its prompt
    if wrong == 1.0:  # every draft rejected: one token a lane a pass, as without a drafter
        assert rows == sum(after_prompt)
    if wrong == 0.0:  # every draft accepted: 1 + most tokens a lane a pass
        assert rows == sum(-(-n // (1 + most)) for n in after_prompt)


async def test_a_draft_is_cut_at_max_tokens_and_at_a_stop_string_inside_it():
    (alone,), _ = await run([Request((3, 4, 5), greedy(12, ignore_eos=True))])
    stop = f"t{alone.tokens[6]} "  # a token that a draft from the start would carry in its middle
    batch = [Request((3, 4, 5), greedy(5, ignore_eos=True)), Request((3, 4, 5), greedy(12, ignore_eos=True, stop=(stop,)))]
    solo = [(await run([request]))[0][0] for request in batch]
    together, plans = await run(batch, FakeDrafter(VOCAB, 0.0), 8)
    assert [seen(o) for o in together] == [seen(o) for o in solo]
    assert together[0].last.reason == "length" and len(together[0].tokens) == 5
    assert together[1].last.reason == "stop" and stop not in together[1].text
    capped = [w for p in plans for w in p.work if w.draft and w.sample.params.max_tokens == 5]
    assert capped and all(w.sample.step + len(w.draft) < 5 for w in capped)  # never a row past max_tokens


async def test_a_draft_across_a_block_boundary_writes_both_blocks_and_keeps_the_books():
    batch = [Request(tuple(range(3, 17)), greedy(20, ignore_eos=True))]  # 14 prompt tokens: drafts cross 16
    solo, _ = await run(batch)
    together, plans = await run(batch, FakeDrafter(VOCAB, 0.0), 4)
    assert [seen(o) for o in together] == [seen(o) for o in solo]
    crossing = [w for p in plans for w in p.work if w.draft and w.piece.start < 16 < w.piece.end]
    assert crossing and len(crossing[0].piece.blocks) == 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.integers(1, 40), min_size=1, max_size=4), most=st.integers(1, 8),
       wrong=st.sampled_from([0.0, 0.5, 1.0]), max_tokens=st.integers(1, 30), seeded_=st.booleans(),
       stop=st.booleans(), seed=st.integers(0, 1000))
def test_any_drafts_give_the_solo_tokens(prompts, most, wrong, max_tokens, seeded_, stop, seed):
    """Prompts of 1 to 40 tokens (so drafts start and cross every place of a block), drafts of 1 to 8 tokens
    all right, half or all wrong, max_tokens and a stop string (one of the fake's token texts) anywhere."""
    def params(i):
        more = {"stop": (f"t{(seed + i) % VOCAB} ",)} if stop else {}
        if seeded_:
            return seeded(seed + i, max_tokens, **more)
        return greedy(max_tokens, **more)

    batch = [Request(tuple(range(2, 2 + n)), params(i)) for i, n in enumerate(prompts)]

    async def both():
        solo = [(await run([request]))[0][0] for request in batch]
        together, _ = await run(batch, FakeDrafter(VOCAB, wrong, seed=seed), most)
        return solo, together

    solo, together = trio.run(both)
    assert [seen(o) for o in together] == [seen(o) for o in solo]


async def test_the_cost_model_learns_from_decode_passes_alone(monkeypatch):
    """A prompt's rows cost less each than a verify row's; one pass of hundreds of them would set the line's
    slope, so passes that carry prompt rows are not reported to it."""
    from lanes.core.drafting import Drafting

    reported = []
    monkeypatch.setattr(Drafting, "passed", lambda self, rows, seconds, ahead=False: reported.append(rows))
    _, plans = await run(requests(), FakeDrafter(VOCAB, 0.3, seed=1), 4)
    assert any(p.prefills for p in plans) and reported
    assert reported == [p.rows for p in plans if not p.prefills]


async def test_the_cost_models_learn_fresh_and_ahead_passes_apart(monkeypatch):
    """A pass planned ahead of its predecessor's result is timed into the `ahead` line, one planned after it
    (every drafted pass) into the `fresh` line: the load control weighs a draft against a plain pass ahead."""
    from lanes.core.drafting import Drafting

    backend = FakeBackend(lanes=4, blocks=64, vocab=VOCAB, max_model_len=512)
    reported, learn = [], Drafting.passed

    def passed(self, rows, seconds, ahead=False):
        reported.append((rows, ahead, backend.plans[-1]))
        learn(self, rows, seconds, ahead)

    monkeypatch.setattr(Drafting, "passed", passed)
    async with running(backend, drafts=FakeDrafter(VOCAB, 1.0, seed=3), draft_tokens=4) as core:  # all wrong
        streams = [await core.submit(request) for request in requests(max_tokens=120)]
        for stream in streams:
            await collect(stream)
    assert all(rows == plan.rows and not plan.prefills for rows, _, plan in reported)
    assert all(not ahead for _, ahead, plan in reported if plan.drafted)
    assert any(ahead for _, ahead, _ in reported)  # failed drafts stop: later passes are planned ahead


class DryPeeking:
    """A source that never finds a draft, and says so when peeked (`lanes.drafts`' ngram and suffix can)."""

    def peek(self, job, after, most):
        return ()

    def propose(self, job, most):
        return ()

    def forget(self, job):
        pass


async def test_a_source_that_says_it_finds_nothing_costs_no_fresh_pass():
    """A fresh pass is planned only to carry a draft: a dry ask no longer costs one (the source is peeked
    first), so the decode passes after each prompt's are planned ahead, as without a drafter."""
    backend = FakeBackend(lanes=4, blocks=64, vocab=VOCAB, max_model_len=512)
    async with running(backend, drafts=DryPeeking(), draft_tokens=4) as core:
        streams = [await core.submit(request) for request in requests(max_tokens=60)]
        for stream in streams:
            await collect(stream)
        stats = core.statistics().drafts
    prompt_passes = sum(1 for plan in backend.plans if plan.prefills)
    assert stats.pieces == 0 and not any(plan.drafted for plan in backend.plans)
    assert stats.fresh.passes <= prompt_passes and stats.ahead.passes > 50, (stats, prompt_passes)


class Late(FakeDrafter):
    """Finds nothing for a stream's first four tokens, then the fake's own draws (prompt lookup at a start)."""

    def propose(self, job, most):
        return super().propose(job, most) if len(job.generated) > 3 else ()


async def test_with_fixed_lengths_a_stream_drafts_once_its_source_finds_a_draft_on_a_device_that_feeds():
    """Tests and the fuzzer fix every lane's draft at its most: no chain of fed passes starts while a drafter
    wants drafts, so a source dry at first still drafts once it finds one."""
    backend = FakeBackend(lanes=2, blocks=64, vocab=VOCAB, max_model_len=512, feeds=True)
    async with running(backend, drafts=Late(VOCAB, 0.0), draft_tokens=4, draft_control=False) as core:
        outcome = await collect(await core.submit(Request(tuple(range(3, 8)), greedy(30, ignore_eos=True))))
    (alone,), _ = await run([Request(tuple(range(3, 8)), greedy(30, ignore_eos=True))])
    assert seen(outcome) == seen(alone)
    assert [p.drafted for p in backend.plans[:4]] == [0, 0, 0, 0] and all(p.drafted for p in backend.plans[4:-1])
    assert not any(p.fed for p in backend.plans)
