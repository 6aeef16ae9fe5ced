"""The fuzzer over the real lane core: a CI budget of seeded scenarios passes, Hypothesis-built scenarios
pass, and each planted race (a monkeypatched copy of a known bug, never left in the code) is found within
the CI budget by what the race breaks; a Hypothesis-found failure shrinks to a small scenario.

Rules: scenarios run the real lane core, prompt cache and decider on the fake backend (or the tiny torch
model) under a seeded deterministic Trio schedule and `MockClock(autojump_threshold=0)`; the budgets are
set by FUZZ_SECONDS (default 70 s of seeded scenarios) and FUZZ_TORCH_SECONDS (default 20 s);
`python -m fuzz --seconds N` runs any budget by hand.
"""

import os
import re
import time

import pytest
from hypothesis import HealthCheck, find, given, settings

from fuzz.run import FuzzFailure, run_one, run_seed
from fuzz.scenarios import decode, encode, scenarios
from lanes.core.admission import Admission
from lanes.core.commands import WarmCancelled
from lanes.core.lane_core import LaneCore
from lanes.core.stream import Finished

BUDGET = float(os.environ.get("FUZZ_SECONDS", "70"))
TORCH_BUDGET = float(os.environ.get("FUZZ_TORCH_SECONDS", "20"))


def fuzz_for(seconds: float, first_seed: int = 0, backend: str = "fake", at_least: int = 0) -> int:
    """Run scenarios from `first_seed` for `seconds`, and `at_least` of them on a busy machine; returns how many
    passed (FuzzFailure propagates)."""
    start, seed = time.monotonic(), first_seed
    while time.monotonic() - start < seconds or seed - first_seed < at_least:
        run_seed(seed, backend)
        seed += 1
    return seed - first_seed


def test_the_ci_budget_of_seeded_scenarios_passes():
    fuzz_for(BUDGET, at_least=100)  # a broken invariant raises FuzzFailure with its reproducer


def test_a_smaller_budget_on_the_tiny_torch_model_passes():
    fuzz_for(TORCH_BUDGET, first_seed=50_000, backend="torch", at_least=10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scn=scenarios())
def test_hypothesis_built_scenarios_pass_and_encode_to_one_line(scn):
    assert decode(encode(scn)) == scn
    run_one(scn)


def plant_launch_after_cancel(monkeypatch) -> None:
    """The seed's launch after cancel: a waiting warm pass that yields to a newer request is finished (answered
    cancelled, gone from the books) but stays queued, so the next quiet moment launches it. The crash is the
    real effect, as the seed's was: the launched pass's end answers its waiter a second time, which the
    one-shot reply refuses ("a reply answered twice")."""

    def yield_warm(self):
        for job, reply in self.warm:
            if self.jobs.pop(job.id, None) is not None:  # finished once, as the real cancel does
                reply.fail(WarmCancelled())
        for job in self.jobs_in_lanes():
            if job.kind == "warm":
                self.cancel(job)

    monkeypatch.setattr(Admission, "yield_warm", yield_warm)


def plant_unpin_before_use(monkeypatch) -> None:
    """The seed's unpin before use: the one pin on a cached prefix is let go at its lookup, before the job has
    taken the prefix's blocks (moved, not doubled: nothing unpins it again), so the reclaim that makes room
    for that job can free them first; the job's restore then shares blocks that are free, which the pool
    refuses ("fork of block N, which is not in use")."""
    lookup, room_for = Admission.lookup, Admission.room_for

    def early_unpin(self, job):
        match = lookup(self, job)
        if match.node is not None:
            self._cache.unpin(match.node)
        return match

    def room_without_pin(self, blocks, match):
        return room_for(self, blocks, None)  # the pin is gone already

    def report_without_pin(self, job):
        self._restores.pop(job.id)  # the pin is gone already

    monkeypatch.setattr(Admission, "lookup", early_unpin)
    monkeypatch.setattr(Admission, "room_for", room_without_pin)
    monkeypatch.setattr(Admission, "report_restore", report_without_pin)


def plant_cancel_leaves_it_queued(monkeypatch) -> None:
    """A cancel that answers a queued stream but forgets to take it out of the queue."""
    original = LaneCore._on_cancel

    def on_cancel(self, command):
        job = self._admission.jobs.get(command.stream_id)
        if job is not None and job.kind == "stream" and job.phase.name == "QUEUED":
            self._delivery.answer(job, Finished("cancelled"))
            return
        original(self, command)

    monkeypatch.setattr(LaneCore, "_on_cancel", on_cancel)


PLANTS = [(plant_launch_after_cancel, r"crashed: IntegrityError: a reply answered twice(;|$)"),
          (plant_unpin_before_use, r"crashed: IntegrityError: fork of block \d+, which is not in use$"),
          (plant_cancel_leaves_it_queued, r"crashed: IntegrityError: job \d+ takes a lane after its end(;|$)")]


@pytest.mark.parametrize("plant, effect", PLANTS, ids=[plant.__name__.removeprefix("plant_") for plant, _ in PLANTS])
def test_the_fuzzer_finds_each_planted_race_by_its_effect_within_the_ci_budget(plant, effect, monkeypatch):
    plant(monkeypatch)
    with pytest.raises(FuzzFailure) as found:
        fuzz_for(BUDGET)
    assert re.match(effect, found.value.message), found.value.message
    assert found.value.reproducer == f"python -m fuzz --seed {found.value.seed} --one"


def test_a_failure_hypothesis_finds_shrinks_to_a_small_scenario_with_a_one_line_reproducer(monkeypatch):
    plant_launch_after_cancel(monkeypatch)
    from hypothesis.internal.conjecture import providers

    if hasattr(providers, "_get_local_constants"):  # Hypothesis mixes in our sources' literals: keep the search fixed
        monkeypatch.setattr(providers, "_get_local_constants", lambda: type(providers._local_constants)())
        if hasattr(providers, "CONSTANTS_CACHE"):  # (and earlier tests' searches cached them)
            monkeypatch.setattr(providers, "CONSTANTS_CACHE", {})

    def fails(scn) -> bool:
        try:
            run_one(scn, solo=False)  # the plant's effect is a crash: the solo runs would only cost time
        except FuzzFailure:
            return True
        return False

    smallest = find(scenarios(), fails, settings=settings(max_examples=200, database=None, deadline=None, derandomize=True,
                                                          suppress_health_check=list(HealthCheck)))
    # What the race needs and little more: a warm pass, and a newer request (or the end) that makes it yield.
    assert 1 <= len(smallest.warms) and len(smallest.streams) + len(smallest.warms) <= 3, smallest
    assert smallest.decisions == () and smallest.device_lost_at is None, smallest
    with pytest.raises(FuzzFailure) as found:
        run_one(smallest)
    command, blob = found.value.reproducer.rsplit(" ", 1)
    assert command == "python -m fuzz --scenario" and "\n" not in blob and decode(blob) == smallest
