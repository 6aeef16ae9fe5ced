"""Where drafts come from, and how long they are: prompt lookup, the suffix index, the draft model, and the
load control that gives each lane its draft length.

Rules: sources are driven with plain job records (a prompt, the tokens generated so far); the draft model's
drafts are checked against transformers' own greedy continuation of the same context with the same tiny
weights; exact assertions.
"""

from dataclasses import dataclass, field

import pytest
import torch
import trio

import tiny
from lanes.core.drafting import EXPLORE, MARGIN, PROBE, Draft, Drafting
from lanes.drafts.model import DraftModel
from lanes.drafts.ngram import NgramDrafter
from lanes.drafts.suffix import SuffixDrafter
from lanes.gpu.device import choose
from lanes.loader import load_model


@dataclass
class Stream:
    id: int
    prompt: tuple[int, ...]
    generated: list[int] = field(default_factory=list)
    limit: int = 200
    media: tuple = ()

    @property
    def max_new(self) -> int:
        return self.limit - len(self.prompt)


def test_prompt_lookup_proposes_what_followed_the_longest_repeated_ngram_latest():
    drafter = NgramDrafter(longest=3, shortest=2)
    job = Stream(1, (5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6))
    assert drafter.propose(job, 3) == (7, 1, 2)  # "5 6" last came before "7 1 2" (not the earlier "7 8 9")
    assert drafter.propose(job, 3).kind == 2  # a draft's kind is its n-gram's length
    job.generated += [7, 1]  # "6 7 1" now ends the context: its 3-gram occurred once, followed by "2 5 6"
    assert drafter.propose(job, 4) == (2, 5, 6, 7) and drafter.propose(job, 4).kind == 3
    assert drafter.propose(Stream(2, (1, 2, 3, 4)), 4) == ()  # nothing repeats
    drafter.forget(job)
    assert 1 not in drafter._contexts


def test_the_suffix_index_drafts_from_the_stream_and_from_finished_outputs_while_likely():
    drafter = SuffixDrafter(depth=4, floor=0.3)
    first = Stream(1, (3, 4))
    first.generated += [10, 11, 12, 13, 14, 15]
    assert drafter.propose(first, 5) == ()  # nothing seen yet follows "15"
    drafter.forget(first)  # its output joins the server's index
    second = Stream(2, (8, 10, 11))
    assert drafter.propose(second, 3) == (12, 13, 14)  # "10 11" was followed by "12 13 14" in the first's output
    third = Stream(3, (1, 2, 1, 3, 1, 2, 1, 3, 1))  # the longest runs at its end were followed one way only
    assert drafter.propose(third, 6) == (2, 1, 3, 1, 2, 1)


def test_a_suffix_draft_grows_while_its_likelihood_stays_above_the_floor():
    context = (7, 1, 2, 9, 1, 3, 9, 1)  # "1" was followed by 2 once and by 3 once: a share of 0.5 each
    assert SuffixDrafter(depth=1, floor=0.6).propose(Stream(1, context), 5) == ()
    # 2 (0.5), then 9 (1.0 of "2"'s followers), 1 (1.0 of "9"'s), then "1" again: 0.25 falls below 0.4
    assert SuffixDrafter(depth=1, floor=0.4).propose(Stream(1, context), 5) == (2, 9, 1)


def test_the_server_index_keeps_its_budget_of_tokens_and_forgets_the_oldest_outputs_whole():
    drafter = SuffixDrafter(depth=3, budget=10)
    for i, output in enumerate([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]]):
        job = Stream(i, (1,))
        job.generated += output
        drafter.propose(job, 1)
        drafter.forget(job)
    assert drafter._kept_tokens == 6 and (20,) not in drafter._shared.followers  # the first went, entirely
    assert dict(drafter._shared.followers[(30, 31)]) == {32: 1}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny.build("llama", folder, max_position_embeddings=512).eval()
    return reference, load_model(folder, choose("cpu", "fp32"), kv_blocks=64, quiet=True)


def greedy_continuation(reference, context: tuple[int, ...], k: int) -> tuple[int, ...]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([context]), max_new_tokens=k, do_sample=False, min_new_tokens=k)
    return tuple(out[0, len(context):].tolist())


async def test_the_draft_model_drafts_its_greedy_continuation_and_rolls_back_by_writing_again(tiny_pair):
    reference, model = tiny_pair
    drafter = DraftModel(model)
    job = Stream(1, tuple(range(5, 25)))
    await drafter.prepare([job], {1: 4})
    first = drafter.propose(job, 4)
    assert first == greedy_continuation(reference, job.prompt, 4)
    job.generated += [first[0], 99]  # the target kept the first draft token, then drew another
    await drafter.prepare([job], {1: 3})
    context = (*job.prompt, *job.generated)
    assert drafter.propose(job, 3) == greedy_continuation(reference, context, 3)
    assert drafter.propose(job, 1) == drafter.propose(job, 3)[:1]
    drafter.check_integrity()
    drafter.forget(job)
    assert drafter.pool.free == drafter.pool.total


class Source:
    def propose(self, job, most):
        return (1,) * most

    def forget(self, job):
        pass


def test_load_control_drafts_while_a_row_pays_and_nothing_when_rows_are_dear_or_drafts_fail():
    jobs = [Stream(i, (1,)) for i in range(4)]
    drafting = Drafting(Source(), most=6)
    trio.run(lambda: drafting.begin(jobs))  # the first decision explores: plain passes ahead get timed
    assert set(drafting.plan(jobs).values()) == {0}
    trio.run(lambda: drafting.begin(jobs))
    assert set(drafting.plan(jobs).values()) == {6}  # no cost yet
    for rows, seconds in [(1, 0.100), (8, 0.1035), (64, 0.1315), (4, 0.1015)]:  # a row costs 0.5 ms over 99.5 ms
        drafting.passed(rows, seconds)
    assert drafting.fresh.per_row == pytest.approx(0.0005, rel=1e-6) and drafting.fresh.fixed == pytest.approx(0.0995, rel=1e-6)
    cheap = drafting._choose(jobs)
    assert set(cheap.values()) == {6}  # acceptance 0.6 a token: every draft token pays for its row
    for job in jobs[1:]:
        drafting.observe(job, 6, 6)  # the other lanes' first drafts are kept whole
    for _ in range(30):
        drafting.observe(jobs[0], 6, 0)  # the first lane's drafts all fail: its rate decays by 0.8^30
    assert drafting._choose(jobs)[0] == 0 and drafting._choose(jobs)[1] == 6
    dear = Drafting(Source(), most=6)
    for rows, seconds in [(1, 0.010), (8, 0.045), (64, 0.325)]:  # a row costs 5 ms over 5 ms fixed
        dear.passed(rows, seconds)
    crowd = [Stream(i, (1,)) for i in range(32)]
    assert sum(dear._choose(crowd).values()) < sum(dear._choose(jobs).values()) // 4 + 8  # a big pass drafts little
    assert set(dear._choose(crowd).values()) == {0}
    drafting.ended(jobs[0])
    # a new stream starts from every stream's drafts lately: 30 failures after 3 kept
    assert drafting._choose(jobs)[0] == 0
    for _ in range(30):
        for job in jobs[1:]:
            drafting.observe(job, 6, 6)
    assert drafting._choose([Stream(9, (1,))]) == {9: 6}


def test_load_control_rates_a_first_draft_token_and_each_later_one_given_the_ones_before_it_were_kept():
    """A draft of 8 with 2 kept tried its first token (kept) and two later ones (one kept): the first is kept
    always, a later one 1 time in 2. A draft that starts right goes on right, so the two are learnt apart: a
    lane whose drafts fail at once or are kept whole keeps every later token it tries."""
    jobs = [Stream(i, (1,)) for i in range(3)]
    drafting = Drafting(Source(), most=8)
    for rows, seconds in [(1, 0.010), (9, 0.022), (17, 0.034)]:  # 1.5 ms a row over 8.5 ms fixed
        drafting.passed(rows, seconds)
    for i in range(60):
        drafting.observe(jobs[0], 8, 2)
        drafting.observe(jobs[1], 4, 4)
        drafting.observe(jobs[2], 8, 8 * (i % 2))
    assert drafting._rates(0) == pytest.approx((1, 1 / 2), rel=1e-5)
    assert drafting._rates(1) == pytest.approx((1, 1), rel=1e-5)
    first, later = drafting._rates(2)
    assert first == pytest.approx(1 / 1.8, rel=1e-5) and later == pytest.approx(1, rel=1e-5)  # kept 1/(1 + 0.8)
    # lane 0's first token and lane 1's 8 rows, not lane 0's second (1/2 x 25 ms < 11 tokens x 1.5 ms)
    assert drafting._choose(jobs[:2]) == {0: 1, 1: 8}


class Dry:
    """Finds a draft for the streams listed, never for the others."""

    def __init__(self, finds) -> None:
        self.finds = finds

    def propose(self, job, most):
        return (1,) * most if job.id in self.finds else ()

    def forget(self, job):
        pass


def test_load_control_stops_asking_for_streams_whose_source_finds_no_draft():
    """A dry ask costs no row, but a pass that asks cannot be planned ahead of its predecessor's result:
    a stream's gain is weighed by how often its source found a draft when asked."""
    jobs = [Stream(i, (1,)) for i in range(2)]
    drafting = Drafting(Dry({1}), most=4)
    for rows, seconds in [(2, 0.020), (6, 0.026), (10, 0.032)]:  # 1.5 ms a row over 17 ms fixed
        drafting.passed(rows, seconds)
    assert drafting._choose(jobs)[0] > 0  # first taken to find one whenever asked
    for _ in range(20):
        for job in jobs:
            drafting.propose(job, 4)
    lengths = drafting._choose(jobs)
    assert lengths[0] == 0 and lengths[1] == 3  # lane 1 as before: its fourth token (0.6^4) does not pay


def test_load_control_that_drafts_nothing_still_probes_one_token_less_and_less_often():
    """A fit that makes rows dear and the fixed cost nothing (one stalled pass can) must not end drafting; but a
    probe is a fresh pass, dear on a GPU, so each one doubles the decisions to the next."""
    jobs = [Stream(i, (1,)) for i in range(3)]
    drafting = Drafting(Source(), most=6)
    for rows, seconds in [(1, 0.001), (4, 0.004), (16, 0.016)]:  # all per row, nothing fixed: no draft pays
        drafting.passed(rows, seconds)
    drafting.observe(jobs[1], 4, 4)  # lane 1's drafts were all kept: it is the one probed
    drafting.passed(3, 0.003, ahead=True)  # a plain pass ahead is timed already: no decision explores
    plans = []
    for _ in range(7 * PROBE):
        trio.run(lambda: drafting.begin(jobs))
        plans.append(dict(drafting.plan(jobs)))
    assert [i for i, p in enumerate(plans) if sum(p.values())] == [PROBE - 1, 3 * PROBE - 1, 7 * PROBE - 1]
    assert plans[PROBE - 1] == {0: 0, 1: 1, 2: 0}


def test_load_control_drafts_only_what_beats_a_plain_pass_planned_ahead():
    """On a GPU a pass planned ahead of its predecessor's result hides the host's work under the device's:
    a drafted pass, planned afresh, must make tokens faster than that, not just faster than a fresh plain pass."""
    jobs = [Stream(i, (1,)) for i in range(4)]
    drafting = Drafting(Source(), most=4)
    for rows, seconds in [(4, 0.0030), (8, 0.0031), (16, 0.0033)]:  # fresh: 3 ms, 25 us a row more
        drafting.passed(rows, seconds)
    for _ in range(20):
        drafting.observe(jobs[0], 4, 4)  # lane 0's drafts are all kept
        for job in jobs[1:]:
            drafting.observe(job, 4, 1)  # the others' first token is kept, the second never
    assert drafting._choose(jobs) == {0: 4, 1: 1, 2: 1, 3: 1}  # against fresh passes alone these tokens pay
    for _ in range(3):
        drafting.passed(4, 0.0010, ahead=True)  # a plain pass planned ahead: 1 ms
    # drafted: 4 + 4 (lane 0) + 3 x 1 tokens in 2.9 + 11 x 0.025 ms = 3.5 a ms, plain 4 a ms
    assert drafting._choose(jobs) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert drafting.would_draft(jobs) is False
    for _ in range(3):
        drafting.passed(4, 0.0025, ahead=True)  # a host-bound pass planned ahead gains little
    assert drafting.would_draft(jobs) is True
    chosen = dict(drafting._ready)
    trio.run(lambda: drafting.begin(jobs))
    assert drafting.plan(jobs) == chosen == {0: 4, 1: 1, 2: 1, 3: 1}  # the fresh plan drafts what was decided


def test_load_control_that_always_drafts_times_a_plain_pass_ahead_every_explore_decisions():
    """Drafts that pay by the fresh line alone would keep every pass fresh, and what a plain pass planned ahead
    costs would never be learnt: once EXPLORE decisions have gone by without one, a decision drafts nothing."""
    jobs = [Stream(i, (1,)) for i in range(2)]
    drafting = Drafting(Source(), most=4)
    for rows, seconds in [(2, 0.0100), (6, 0.0104), (10, 0.0108)]:  # rows nearly free: every token pays
        drafting.passed(rows, seconds)
    sums = []
    for _ in range(2 * EXPLORE + 2):
        trio.run(lambda: drafting.begin(jobs))
        sums.append(sum(drafting.plan(jobs).values()))
    assert [i for i, n in enumerate(sums) if n == 0] == [0, EXPLORE + 1]
    drafting.passed(2, 0.001, ahead=True)  # a plain pass ahead was timed: no exploring for EXPLORE more
    drafted = []
    for _ in range(EXPLORE):
        if drafting.would_draft(jobs):
            drafted.append(sum(drafting._ready.values()))
    assert drafted == [1] * 4  # 2 tokens a ms ahead beat any drafted pass here: probes alone, after 16, 32, 64, 128


def test_a_peek_is_what_the_source_proposes_once_the_drawn_tokens_are_the_streams():
    """Load control asks before a pass's draws are applied: prompt lookup's peek at the drawn tokens equals
    its proposal once they are the stream's (the n-grams they make looked for among the unindexed positions)."""
    import random

    rng = random.Random(1)
    for _ in range(500):
        vocab = rng.choice([3, 5, 20])
        prompt = tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 30)))
        drawn = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        split = rng.randint(max(0, len(drawn) - 3), len(drawn))
        peeking, proposing = NgramDrafter(), NgramDrafter()
        for drafter in (peeking, proposing):
            for i in range(split + 1):
                drafter.propose(Stream(1, prompt, drawn[:i]), 4)
        assert peeking.peek(Stream(1, prompt, drawn[:split]), drawn[split:], 4) == proposing.propose(Stream(1, prompt, drawn), 4)
    suffix = SuffixDrafter(depth=4, floor=0.3)
    job = Stream(2, (8, 10, 11, 12, 8, 10))
    assert suffix.peek(job, (), 3) == suffix.propose(job, 3) == (11, 12, 8)
    assert suffix.peek(job, (11,), 2) == (12, 8) and suffix.propose(job, 3) == (11, 12, 8)  # a peek changes nothing


class Peeking(Source):
    """Proposes `draft` to the streams listed, nothing to the others, and can say so before it is asked."""

    def __init__(self, finds, draft=(1, 2, 3, 4)) -> None:
        self.finds, self.draft, self.peeked = finds, draft, []

    def peek(self, job, after, most):
        self.peeked.append((job.id, tuple(after)))
        return self.draft[:most] if job.id in self.finds else ()

    def propose(self, job, most):
        return self.peek(job, (), most)


def test_load_control_with_a_peeking_source_plans_no_fresh_pass_for_a_dry_ask():
    """A fresh pass costs the device a wait for the host: when the source says no lane would find a draft, the
    passes stay planned ahead; a lane drafts at most what its source has."""
    jobs = [Stream(i, (1,), [5]) for i in range(3)]
    source = Peeking(set(), draft=(1, 2))
    drafting = Drafting(source, most=4)
    for rows, seconds in [(3, 0.0100), (9, 0.0106), (18, 0.0115)]:  # rows nearly free: every token pays
        drafting.passed(rows, seconds)
    drafting.passed(3, 0.009, ahead=True)  # a plain pass ahead is timed already: no decision explores
    assert drafting._choose(jobs) == {0: 4, 1: 4, 2: 4}  # unpeeked, every lane is taken to find a draft
    assert drafting.would_draft(jobs, {0: (7,), 2: (8, 9)}) is False
    assert source.peeked == [(0, (7,)), (1, ()), (2, (8, 9))]
    source.finds = {1}
    assert drafting.would_draft(jobs) is True and drafting._ready == {0: 0, 1: 2, 2: 0}


def test_a_lane_that_does_not_draft_learns_its_rate_from_its_would_be_drafts():
    """Each peeked draft is scored against the tokens its lane then draws (a drafted token is kept exactly
    when it equals the lane's draw): a lane learns its rate without a drafted pass, and its source's
    finding rate too."""
    copying, wandering, dry = Stream(0, (1,), [5]), Stream(1, (1,), [5]), Stream(2, (1,), [5])
    jobs = [copying, wandering, dry]
    drafting = Drafting(Peeking({0, 1}), most=4)
    for rows, seconds in [(3, 0.003), (12, 0.012), (24, 0.024)]:  # all per row: no draft pays, nothing drafts
        drafting.passed(rows, seconds)
    drafting.passed(3, 0.003, ahead=True)
    for _ in range(12):
        assert drafting.would_draft(jobs) is False  # each lane's draft (1, 2, 3, 4) is kept to be scored
        copying.generated += [1, 2, 3, 4]  # what it drew: its whole draft, kept
        wandering.generated += [1, 9, 9, 9]  # one kept, the second tried and failed
        dry.generated += [7, 7, 7, 7]
    drafting._score(jobs)
    drafts = (1 - 0.8 ** 12) / 0.2  # the decayed count of 12 drafts
    first = (0.8 ** 12 * 1.2 + drafts) / (0.8 ** 12 * 2 + drafts)  # lane 0's first token kept every time
    assert drafting._rates(0) == pytest.approx((first, (0.8 ** 12 * 1.2 + 3 * drafts) / (0.8 ** 12 * 2 + 3 * drafts)))
    # lane 1's record started from every stream's after lane 0's first draft (1 of 1 first, 3 of 3 later kept)
    start = (2 * (0.95 * 1.2 + 1) / (0.95 * 2 + 1), 2 * (0.95 * 1.2 + 3) / (0.95 * 2 + 3))
    assert drafting._rates(1) == pytest.approx(((0.8 ** 12 * start[0] + drafts) / (0.8 ** 12 * 2 + drafts),
                                                0.8 ** 12 * start[1] / (0.8 ** 12 * 2 + drafts)))  # its second failed
    shared = (1.2, 2.0, 1.2, 2.0)  # a lane yet to draft takes every stream's record: lanes 0 and 1 in turn
    for _ in range(12):
        for outcome in ((1, 1, 3, 3), (1, 1, 0, 1)):
            shared = tuple(0.95 * value + new for value, new in zip(shared, outcome))
    assert drafting._rates(2) == pytest.approx((shared[0] / shared[1], shared[2] / shared[3]))
    assert drafting._found[2][0] == pytest.approx(0.8 ** 12)
    assert drafting.statistics().pieces == 0  # nothing was drafted


def test_load_control_asks_as_often_as_an_ask_costs_a_twentieth_of_the_passes_it_spans():
    """An ask (peeks, scores, the decision) is host time: on a CPU's 20 ms passes it is asked every pass, on a
    GPU's fed 1 ms passes with many lanes every few."""
    jobs = [Stream(i, (1,), [5]) for i in range(8)]
    drafting = Drafting(Peeking(set()), most=4)
    assert drafting.asks_every() == 1  # no pass ahead timed yet
    for _ in range(3):
        drafting.passed(8, 0.020, ahead=True)
    drafting.would_draft(jobs)
    assert drafting._asked < 0.001 and drafting.asks_every() == 1
    fast = Drafting(Peeking(set()), most=4)
    for _ in range(3):
        fast.passed(8, 0.001, ahead=True)
    fast.would_draft(jobs)
    fast._asked = 0.00018  # as 64 lanes' peeks took on a GPU's host
    assert fast.asks_every() == 4
    fast._asked = 0.01
    assert fast.asks_every() == 16  # at most MOST_ASK


class Kinds:
    """Drafts of the kind asked for: the test says which each lane's next draft is."""

    def __init__(self) -> None:
        self.kinds: dict[int, int] = {}

    def propose(self, job, most):
        return Draft((1,) * most, kind=self.kinds[job.id])

    def forget(self, job):
        pass


def test_load_control_keeps_a_record_for_each_kind_of_draft():
    """Prompt lookup's 4-gram matches hold where its 2-gram ones fail (a copy goes on; a 2-gram recurs by
    chance): a lane's drafts are rated by their kind, so it drafts long on the one and nothing on the other."""
    job = Stream(0, (1,))
    source = Kinds()
    drafting = Drafting(source, most=8)
    for rows, seconds in [(1, 0.010), (9, 0.022), (17, 0.034)]:  # 1.5 ms a row over 8.5 ms fixed
        drafting.passed(rows, seconds)
    for _ in range(20):
        for kind, kept in ((4, 8), (2, 0)):
            source.kinds[0] = kind
            drafting.observe(job, len(drafting.propose(job, 8)), kept)
    assert min(drafting._rates(0, 4)) > 0.99 and drafting._rates(0, 2)[0] < 0.01  # 20 drafts of each kind
    peeked = {0: Draft((1,) * 8, kind=4)}
    assert drafting._choose([job], peeked) == {0: 8}
    assert drafting._choose([job], {0: Draft((1,) * 8, kind=2)}) == {0: 0}
    assert drafting._choose([job]) == {0: 0}  # unpeeked: rated as its latest draft's kind
    fresh = Stream(1, (1,))  # a new stream starts from every stream's record of the kind
    assert drafting._choose([fresh], {1: Draft((1,) * 8, kind=4)}) == {1: 8}
    assert drafting._choose([fresh], {1: Draft((1,) * 8, kind=2)}) == {1: 0}
    assert drafting._rates(1, 3) == pytest.approx((0.6, 0.6))  # a kind no stream has drafted: the prior


def test_load_control_drafts_only_what_beats_a_plain_pass_by_its_margin():
    """Costs and rates are learnt from noisy passes: a drafted pass predicted a few percent faster than a plain
    one lost 4-9% at 8 streams on a 2-core CPU, so it must be predicted MARGIN faster."""
    jobs = [Stream(i, (1,)) for i in range(4)]
    chosen = []
    drafted = 11 / (2.9 + 11 * 0.025)  # tokens a ms: 4 + 4 (lane 0) + 3 x 1 in 2.9 + 11 x 0.025 ms
    for plain_ms in (MARGIN * 4 / drafted * 0.95, MARGIN * 4 / drafted * 1.05):  # plain a little faster, then slower
        drafting = Drafting(Source(), most=4)
        for rows, seconds in [(4, 0.0030), (8, 0.0031), (16, 0.0033)]:  # fresh: 3 ms, 25 us a row more
            drafting.passed(rows, seconds)
        for _ in range(20):
            drafting.observe(jobs[0], 4, 4)
            for job in jobs[1:]:
                drafting.observe(job, 4, 1)
        drafting.passed(4, plain_ms / 1e3, ahead=True)
        chosen.append(drafting._choose(jobs))
    assert 4 / (MARGIN * 4 / drafted * 0.95) < drafted  # the draft beat the plain pass, by less than the margin
    assert chosen == [{0: 0, 1: 0, 2: 0, 3: 0}, {0: 4, 1: 1, 2: 1, 3: 1}]
