"""Scenarios: what a fuzzing run throws at one lane core, all drawn from one seed.

Clients arrive at virtual times: streams of varied sizes (some sharing prefixes, so the prompt cache
restores them), some cancelled after a number of events or at a time, some with deadlines; decisions,
some cancelled; warm passes; restore failures; a lost device (a follower's death, simulated); and a
shutdown at some point with some grace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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
    seed: int
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
    notes: list[str] = field(default_factory=list, compare=False)


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
    )
