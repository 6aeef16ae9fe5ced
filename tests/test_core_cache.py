"""The lane core with its prompt cache: admission restores the longest cached prefix, a prompt's full
blocks are kept after its prompt pass, a failed restore falls back to a fresh prefill, restored
streams give exactly the tokens fresh ones give, and hits and misses count each request once.

Rules: exact plans and tokens on the fake backend (its tokens depend on the KV it reads, so a wrong
restore shows); greedy equality on a tiny torch model; failures injected through the lane core's `restore_fault`; `check_integrity()` (pool and cache) when each core stops.
"""

import pytest
import torch

import tiny
from engine_helpers import Gated, collect, greedy, lanes_of, running
from lanes.core.fake import FakeBackend
from lanes.core.stream import Request

SYSTEM = tuple(range(100, 100 + 48))  # three full blocks


def question(i: int) -> tuple[int, ...]:
    return SYSTEM + (3 + i, 4 + i, 5)


async def test_the_second_request_restores_the_shared_prefix_and_gets_the_same_tokens():
    backend = FakeBackend(lanes=2, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=64) as core:
        first = await collect(await core.submit(Request(question(0), greedy(6, ignore_eos=True))))
        assert first.last.cached_tokens == 0
        assert core.cache.statistics().entries == 3  # its three full blocks were kept
        again = await collect(await core.submit(Request(question(0), greedy(6, ignore_eos=True))))
        other = await collect(await core.submit(Request(question(7), greedy(6, ignore_eos=True))))
        stats = core.cache.statistics()
    assert again.tokens == first.tokens and again.last.cached_tokens == 48
    assert other.last.cached_tokens == 48
    prompt_passes = [lanes_of(p)[0] for p in backend.plans if p.prefills]
    assert [(start, rows) for _, start, rows in prompt_passes] == [(0, 51), (48, 3), (48, 3)]
    assert (stats.hits, stats.misses, stats.entries) == (2, 1, 3)
    alone = await collect_alone(question(7))
    assert other.tokens == alone


async def collect_alone(prompt):
    async with running(FakeBackend(lanes=2, blocks=64), max_rows=64) as core:
        return (await collect(await core.submit(Request(prompt, greedy(6, ignore_eos=True))))).tokens


async def test_a_failed_restore_falls_back_to_a_fresh_prefill():
    backend = FakeBackend(lanes=2, blocks=64)
    failing = []  # from the second request on, every restore fails
    async with running(backend, max_rows=64, cache_bytes=64, restore_fault=lambda: bool(failing)) as core:
        first = await collect(await core.submit(Request(question(0), greedy(6, ignore_eos=True))))
        failing.append(True)
        again = await collect(await core.submit(Request(question(0), greedy(6, ignore_eos=True))))
        stats = core.cache.statistics()
    assert again.tokens == first.tokens and again.last.cached_tokens == 0
    prompt_passes = [lanes_of(p)[0] for p in backend.plans if p.prefills]
    assert [(start, rows) for _, start, rows in prompt_passes] == [(0, 51), (0, 51)]
    assert stats.entries == 3 and stats.dead == 0  # the failed chain went; the fresh prefill kept it again


async def test_a_keep_that_needs_room_evicts_the_least_recent_chain_once_its_restore_reported():
    backend = Gated(lanes=2, blocks=64)
    async with running(backend, max_rows=64, cache_bytes=3) as core:  # room for three blocks only
        await collect(await core.submit(Request(question(0), greedy(2, ignore_eos=True))))
        entered, release = backend.hold()
        restoring = await core.submit(Request(question(1), greedy(2, ignore_eos=True)))
        await entered.wait()  # its pass over the restored prefix is inside the backend: the chain is pinned
        assert [n.pins for n in core.cache._alive.values()] == [1, 1, 1]
        other = await core.submit(Request(tuple(range(300, 348)), greedy(2, ignore_eos=True)))
        release.set()
        assert (await collect(restoring)).last.cached_tokens == 48
        assert (await collect(other)).last.cached_tokens == 0
        stats = core.cache.statistics()
        assert core.cache.lookup(question(0)).tokens == 0  # the old chain made room for the new one
    assert (stats.entries, stats.evictions, stats.failed_keeps, stats.held_bytes) == (3, 3, 0, 3)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lanes.gpu.device import choose
    from lanes.loader import load_model

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tiny.build("qwen3", folder, head_dim=16, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True)


@pytest.mark.parametrize("restore_fails", [False, True])
async def test_restored_prefixes_give_the_tokens_of_a_fresh_prefill_on_a_torch_model(tiny_model, restore_fails):
    from lanes.backend.torch_backend import TorchBackend, text_factory
    from lanes.gpu.device import CpuRunner

    g = torch.Generator().manual_seed(5)
    shared = tuple(torch.randint(0, tiny_model.config.vocab_size, (70,), generator=g).tolist())
    prompts = [shared + tuple(torch.randint(0, 200, (k,), generator=g).tolist()) for k in (3, 9, 17, 1)]

    async def run(cache_bytes, fault=None):
        backend = TorchBackend(tiny_model, CpuRunner(), lanes=2, max_model_len=256)
        options = dict(text=text_factory(tiny_model.tokenizer), stop_ids=(), max_rows=32, cache_bytes=cache_bytes,
                       restore_fault=fault)
        async with running(backend, **options) as core:
            out = []
            for prompt in prompts:  # one after another, so every later one can restore
                out.append(await collect(await core.submit(Request(prompt, greedy(8, ignore_eos=True)))))
            return out

    fresh = await run(0)
    cached = await run(1 << 30, (lambda: True) if restore_fails else None)
    assert [o.tokens for o in cached] == [o.tokens for o in fresh]
    expected = [0, 0, 0, 0] if restore_fails else [0, 64, 64, 64]
    assert [o.last.cached_tokens for o in cached] == expected


async def test_hits_misses_and_hit_tokens_count_each_request_once_even_when_it_waits_for_blocks():
    backend = FakeBackend(lanes=2, blocks=8)
    shared = tuple(range(100, 140))  # two full blocks and 8 tokens
    async with running(backend, max_rows=64, cache_bytes=8) as core:
        await collect(await core.submit(Request(shared, greedy(2, ignore_eos=True))))  # a miss; its 2 blocks kept
        long = await core.submit(Request((3, 4, 5), greedy(80, ignore_eos=True)))  # a miss; its 6 blocks leave none
        await long.events.receive()
        again = await core.submit(Request(shared, greedy(8, ignore_eos=True)))  # a free lane, but no block for it
        assert (await collect(long)).last.reason == "length"
        outcome = await collect(again)
        stats = core.cache.statistics()
    assert outcome.last.cached_tokens == 32
    assert (stats.hits, stats.misses, stats.hit_tokens) == (1, 2, 32)
