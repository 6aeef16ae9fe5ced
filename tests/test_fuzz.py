"""The fuzzer over the real lane core: a CI budget of seeded scenarios passes, Hypothesis draws more,
and each planted race (a monkeypatched copy of a known bug, never left in the code) is found within the
CI budget.

Rules: scenarios run the real lane core, prompt cache and decider on the fake backend under a seeded
deterministic Trio schedule and `MockClock(autojump_threshold=0)`; the budget is set by FUZZ_SECONDS
(default 100 s of scenarios; `python -m fuzz --seconds N` runs any budget by hand).
"""

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.run import FuzzFailure, run_seed
from lanes.core.commands import WarmCancelled
from lanes.core.lane_core import LaneCore
from lanes.core.prompt_cache import Match

BUDGET = float(os.environ.get("FUZZ_SECONDS", "100"))
TORCH_BUDGET = float(os.environ.get("FUZZ_TORCH_SECONDS", "25"))


def fuzz_for(seconds: float, first_seed: int = 0, backend: str = "fake") -> int:
    """Run scenarios from `first_seed` for `seconds`; returns how many passed (FuzzFailure propagates)."""
    start, seed = time.monotonic(), first_seed
    while time.monotonic() - start < seconds:
        run_seed(seed, backend)
        seed += 1
    return seed - first_seed


def test_the_ci_budget_of_seeded_scenarios_passes():
    assert fuzz_for(BUDGET) > 100


def test_a_smaller_budget_on_the_tiny_torch_model_passes():
    assert fuzz_for(TORCH_BUDGET, first_seed=50_000, backend="torch") > 10


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(min_value=10**6, max_value=2**31))
def test_hypothesis_drawn_scenarios_pass(seed):
    run_seed(seed)


def plant_launch_after_cancel(monkeypatch) -> None:
    """The seed's warm-pass crash: a yielded warm pass is answered as cancelled but stays queued, so it is
    launched afterwards."""

    def yield_warm(self):
        for job, reply in self._warm:
            if reply.error is None and reply.value is None:
                reply.fail(WarmCancelled())
        for job in self.lanes:
            if job is not None and job.kind == "warm":
                job.cancelled = True

    monkeypatch.setattr(LaneCore, "_yield_warm", yield_warm)


def plant_unpin_before_use(monkeypatch) -> None:
    """The seed's restore race: the pin on a cached prefix is dropped before the job has taken its blocks,
    so admission's own reclaim can free them first."""
    original = LaneCore._lookup

    def lookup(self, job) -> Match:
        match = original(self, job)
        if match.node is not None:
            self.cache.unpin(match.node)
            job.restore = None
        return match

    def report(self, job) -> None:
        job.restore = None

    monkeypatch.setattr(LaneCore, "_lookup", lookup)
    monkeypatch.setattr(LaneCore, "_report_restore", report)


def plant_cancel_leaves_it_queued(monkeypatch) -> None:
    """A cancel that answers a queued stream but forgets to take it out of the queue."""
    original = LaneCore._on_cancel

    def on_cancel(self, command):
        job = self._jobs.get(command.stream_id)
        if job is not None and job.kind == "stream" and job.phase.name == "QUEUED":
            self._answer(job, __import__("lanes.core.stream", fromlist=["Finished"]).Finished("cancelled"))
            return
        original(self, command)

    monkeypatch.setattr(LaneCore, "_on_cancel", on_cancel)


@pytest.mark.parametrize("plant", [plant_launch_after_cancel, plant_unpin_before_use, plant_cancel_leaves_it_queued],
                         ids=lambda p: p.__name__.removeprefix("plant_"))
def test_the_fuzzer_finds_each_planted_race_within_the_ci_budget(plant, monkeypatch):
    plant(monkeypatch)
    with pytest.raises(FuzzFailure) as found:
        fuzz_for(BUDGET)
    assert "reproduce: python -m fuzz --seed" in str(found.value)
