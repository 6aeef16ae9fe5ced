"""Scenarios: what a fuzzing run throws at one lane core, drawn from one seed or built by Hypothesis.

Clients arrive at virtual times: streams of varied sizes (some sharing prefixes, so the prompt cache
restores them), some cancelled after a number of events or at a time, some with deadlines; decisions,
some cancelled; warm passes; restore failures; a lost device (a follower's death, simulated); and a
shutdown at some point with some grace.

`draw(seed)` is the seeded form (`python -m fuzz --seed S`); `scenarios()` is a Hypothesis strategy over
the same parts, so a failing scenario shrinks to a small one; `encode`/`decode` turn any scenario into
one line and back (the reproducer of a scenario no seed gives).
"""

from __future__ import annotations

import base64
import json
import random
import zlib
from dataclasses import asdict, dataclass, field

PREFIXES = [tuple(range(100 + 50 * k, 100 + 50 * k + 40)) for k in range(3)]  # shared system prompts


@dataclass(frozen=True)
class StreamClient:
    at: float
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None  # None: greedy
    stop: tuple[str, ...] = ()
    deadline: float | None = None  # seconds after `at`
    leave_after: int | None = None  # events received before the client goes away
    cancel_at: float | None = None  # or a time at which it cancels


@dataclass(frozen=True)
class DecisionClient:
    at: float
    prompts: tuple[tuple[int, ...], ...]
    labels: tuple[tuple[int, ...], ...]
    deadline: float | None = None
    cancel_at: float | None = None


@dataclass(frozen=True)
class WarmClient:
    at: float
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class Scenario:
    seed: int  # the schedule's shuffle and the restore failures; for `draw`, also every other choice
    lanes: int
    blocks: int
    max_rows: int
    max_queue: int
    max_decisions: int
    cache_bytes: int
    pass_seconds: float
    streams: tuple[StreamClient, ...]
    decisions: tuple[DecisionClient, ...]
    warms: tuple[WarmClient, ...]
    restore_failure_rate: float
    device_lost_at: int | None  # the pass number that fails
    shutdown_at: float | None
    grace: float
    draft_wrong: float | None = None  # a drafter whose tokens are wrong at this rate (None: no drafts)
    drawn: bool = field(default=False, compare=False)  # `draw(seed)` gives it back: the seed reproduces it


def _prompt(rng: random.Random) -> tuple[int, ...]:
    head = rng.choice(PREFIXES) if rng.random() < 0.5 else ()
    return head + tuple(rng.randrange(2, 49) for _ in range(rng.choice([1, 3, 9, 17, 33, 70])))


def draw(seed: int) -> Scenario:
    """A scenario from `seed` alone."""
    rng = random.Random(seed)
    horizon = rng.choice([5.0, 20.0, 60.0])
    streams = []
    for _ in range(rng.randint(1, 14)):
        leave = rng.random()
        streams.append(StreamClient(
            at=rng.uniform(0, horizon / 2),
            prompt=_prompt(rng),
            max_tokens=rng.choice([1, 2, 5, 12, 30]),
            seed=None if rng.random() < 0.5 else rng.randrange(1 << 30),
            stop=("t7 ",) if rng.random() < 0.15 else (),
            deadline=rng.choice([None, None, 1.0, 5.0, 30.0]),
            leave_after=rng.randint(0, 8) if leave < 0.25 else None,
            cancel_at=rng.uniform(0, horizon) if 0.25 <= leave < 0.4 else None,
        ))
    decisions = []
    for _ in range(rng.choice([0, 0, 1, 2, 4])):
        head = rng.choice(PREFIXES)
        count = rng.randint(1, 4)
        prompts = tuple(head + tuple(rng.randrange(2, 49) for _ in range(rng.randint(1, 12))) for _ in range(count))
        labels = tuple(tuple(rng.sample(range(2, 49), rng.randint(2, 4))) for _ in range(count))
        decisions.append(DecisionClient(rng.uniform(0, horizon / 2), prompts, labels,
                                        deadline=rng.choice([None, 2.0, 20.0]),
                                        cancel_at=rng.uniform(0, horizon) if rng.random() < 0.2 else None))
    warms = [WarmClient(rng.uniform(0, horizon / 2), rng.choice(PREFIXES) + (5, 6)) for _ in range(rng.choice([0, 0, 1, 2]))]
    return Scenario(
        seed=seed,
        lanes=rng.choice([1, 2, 3, 5]),
        blocks=rng.choice([10, 16, 24, 40, 96]),
        max_rows=rng.choice([8, 16, 64]),
        max_queue=rng.choice([1, 4, 64]),
        max_decisions=rng.choice([1, 8]),
        cache_bytes=rng.choice([0, 4, 8, 12, 64]),
        pass_seconds=rng.choice([0.05, 0.2, 1.0]),
        streams=tuple(streams),
        decisions=tuple(decisions),
        warms=tuple(warms),
        restore_failure_rate=rng.choice([0.0, 0.0, 0.3, 1.0]),
        device_lost_at=rng.randint(1, 60) if rng.random() < 0.1 else None,
        shutdown_at=rng.uniform(0, horizon) if rng.random() < 0.4 else None,
        grace=rng.choice([0.0, 2.0, 100.0]),
        draft_wrong=rng.choice([None, None, 0.0, 0.3, 1.0]),  # drawn last: the draws before it stay the seed's
        drawn=True,
    )


def scenarios():
    """A Hypothesis strategy for scenarios built part by part (the same ranges as `draw`). Every part shrinks
    towards the plain case: fewer clients, one-token prompts, no cancel, deadline, restore failure, lost
    device or shutdown, the smallest geometry, time 0."""
    from hypothesis import strategies as st

    def sometimes(draw, tenths: int, strategy):
        # A 0..9 draw in the top `tenths` picks a value; it shrinks to 0, so the value to None.
        return draw(strategy) if draw(st.integers(0, 9)) >= 10 - tenths else None

    def until(limit: float):
        return st.floats(0, limit, allow_nan=False, allow_infinity=False)

    def tokens(min_size: int, max_size: int):
        # Bytes, one draw for a whole run of tokens in 2..48: cheap to build, shrinks to fewer and to 2s.
        return st.binary(min_size=min_size, max_size=max_size).map(lambda raw: tuple(2 + b % 47 for b in raw))

    @st.composite
    def stream(draw, horizon: float) -> StreamClient:
        how = draw(st.sampled_from(("stays", "stays", "stays", "leaves after events", "cancels at a time")))
        return StreamClient(
            at=draw(until(horizon / 2)),
            prompt=draw(st.sampled_from([(), *PREFIXES])) + draw(tokens(1, 70)),
            max_tokens=draw(st.integers(1, 30)),
            seed=sometimes(draw, 5, st.integers(0, (1 << 30) - 1)),
            stop=sometimes(draw, 2, st.just(("t7 ",))) or (),
            deadline=sometimes(draw, 5, st.sampled_from((1.0, 5.0, 30.0))),
            leave_after=draw(st.integers(0, 8)) if how == "leaves after events" else None,
            cancel_at=draw(until(horizon)) if how == "cancels at a time" else None,
        )

    @st.composite
    def decision(draw, horizon: float) -> DecisionClient:
        head = draw(st.sampled_from(PREFIXES))
        labels = st.lists(st.integers(2, 48), min_size=2, max_size=4, unique=True).map(tuple)
        parts = draw(st.lists(st.tuples(tokens(1, 12), labels), min_size=1, max_size=4))
        return DecisionClient(draw(until(horizon / 2)), tuple(head + p for p, _ in parts), tuple(lab for _, lab in parts),
                              deadline=sometimes(draw, 7, st.sampled_from((2.0, 20.0))),
                              cancel_at=sometimes(draw, 2, until(horizon)))

    @st.composite
    def warm(draw, horizon: float) -> WarmClient:
        return WarmClient(draw(until(horizon / 2)), draw(st.sampled_from(PREFIXES)) + (5, 6))

    @st.composite
    def scenario(draw) -> Scenario:
        horizon = draw(st.sampled_from((5.0, 20.0, 60.0)))
        return Scenario(
            seed=draw(st.integers(0, 2**32 - 1)),
            lanes=draw(st.sampled_from((1, 2, 3, 5))),
            blocks=draw(st.sampled_from((10, 16, 24, 40, 96))),
            max_rows=draw(st.sampled_from((8, 16, 64))),
            max_queue=draw(st.sampled_from((64, 4, 1))),
            max_decisions=draw(st.sampled_from((8, 1))),
            cache_bytes=draw(st.sampled_from((0, 4, 8, 12, 64))),
            pass_seconds=draw(st.sampled_from((0.05, 0.2, 1.0))),
            streams=tuple(draw(st.lists(stream(horizon), max_size=14))),
            decisions=tuple(draw(st.lists(decision(horizon), max_size=4))),
            warms=tuple(draw(st.lists(warm(horizon), max_size=2))),
            restore_failure_rate=draw(st.sampled_from((0.0, 0.3, 1.0))),
            device_lost_at=sometimes(draw, 1, st.integers(1, 60)),
            shutdown_at=sometimes(draw, 4, until(horizon)),
            grace=draw(st.sampled_from((100.0, 2.0, 0.0))),
            draft_wrong=sometimes(draw, 5, st.sampled_from((0.3, 0.0, 1.0))),
        )

    return scenario()


def encode(scn: Scenario) -> str:
    """`scn` as one line of URL-safe text (`decode` gives it back)."""
    data = json.dumps({k: v for k, v in asdict(scn).items() if k != "drawn"}, separators=(",", ":"))
    return base64.urlsafe_b64encode(zlib.compress(data.encode(), 9)).decode().rstrip("=")


def decode(text: str) -> Scenario:
    """The scenario `encode` wrote."""
    data = json.loads(zlib.decompress(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))))

    def tuples(value):
        return tuple(tuples(v) for v in value) if isinstance(value, list) else value

    data = {k: tuples(v) for k, v in data.items()}
    data["streams"] = tuple(StreamClient(**{k: tuples(v) for k, v in c.items()}) for c in data["streams"])
    data["decisions"] = tuple(DecisionClient(**{k: tuples(v) for k, v in c.items()}) for c in data["decisions"])
    data["warms"] = tuple(WarmClient(**{k: tuples(v) for k, v in c.items()}) for c in data["warms"])
    return Scenario(**data)
