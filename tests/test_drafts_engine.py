"""Drafted equals plain on real models: with drafts on, every stream gets exactly the tokens, text and end it
gets with drafts off, and the target's logprobs (within 1e-5 on the CPU), whatever share of the drafts is
right, for every draft source, greedy and seeded, with penalties, logit_bias, min_tokens, stop strings, stop
ids and max_tokens in the mix, at 1, 8 and 32 streams at once; the books hold after every pass and no
drafted token reaches the prompt cache.

Rules: tiny transformers checkpoints of each family built here; the real lane core and torch backend on the
CPU; the draft model is the target's own weights (its greedy drafts mostly right) or another tiny model
(mostly wrong); drafts off and on run the same requests at the same concurrency; exact comparisons.
"""

import random

import gguf
import pytest
import trio

import tiny
import tiny_gguf
from engine_helpers import Checked, collect, running
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request, TokenEvent
from lanes.drafts.model import DraftModel
from lanes.drafts.ngram import NgramDrafter
from lanes.drafts.suffix import SuffixDrafter
from lanes.gpu.device import CpuRunner, choose
from lanes.loader import load_model
from lanes.quant.native import unavailable_reason

LANES = 32


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny.build(request.param, folder, max_position_embeddings=512)
    other = tmp_path_factory.mktemp(request.param + "-draft")
    tiny.build(request.param, other, seed=7, max_position_embeddings=512, hidden_size=32, num_hidden_layers=1)
    load = lambda path: load_model(path, choose("cpu", "fp32"), kv_blocks=LANES * 12, quiet=True)  # noqa: E731
    return request.param, load(folder), lambda: load(folder), lambda: load(other)


def requests(tokenizer) -> list[Request]:
    """32 requests: repetitive and plain prompts, greedy and seeded, every parameter a draft must honour."""
    rng = random.Random(3)
    text = tokenizer.decode([rng.randrange(3, 250) for _ in range(3)])
    out = []
    for i in range(32):
        base = [rng.randrange(3, 250) for _ in range(rng.randint(2, 9))]
        prompt = tuple(base * rng.choice([1, 3, 5]))
        common = dict(max_tokens=rng.choice([5, 24, 48]), logprobs=True, top_logprobs=i % 3,
                      ignore_eos=i % 4 != 0, stop_token_ids=(base[0],) if i % 5 == 0 else ())
        extra = [{}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.7, "frequency_penalty": 0.3},
                 {"logit_bias": ((base[-1], 4.0), (7, -100.0))}, {"min_tokens": 6, "stop_token_ids": (base[0],)},
                 {"stop": (text[:2],)}][i % 6]
        params = {**common, **extra}
        params["min_tokens"] = min(params.get("min_tokens", 0), params["max_tokens"])
        if i % 8 == 7:  # output that repeats (a strong bias): every source finds drafts, mostly right ones
            params.update(logit_bias=((base[0], 100.0),), repetition_penalty=1.0, presence_penalty=0.0,
                          frequency_penalty=0.0, max_tokens=48, min_tokens=0)
        if i % 2:
            params.update(temperature=0.8, top_p=0.9, seed=1000 + i)
        else:
            params.update(temperature=0)
        out.append(Request(prompt, SamplingParams(**params)))
    return out


async def run(model, batch: list[Request], at_once: int, drafts=None, most: int = 4, cache: bool = False):
    backend = Checked(TorchBackend(model, CpuRunner(), lanes=LANES, max_model_len=256))
    options = dict(text=text_factory(model.tokenizer), stop_ids=model.tokenizer.eos_ids, drafts=drafts,
                   draft_tokens=most, draft_control=False, cache_bytes=(1 << 30) if cache else 0)
    outcomes = [None] * len(batch)
    async with running(backend, **options) as core:
        backend.core = core
        limiter = trio.Semaphore(at_once)

        async def one(i: int) -> None:
            async with limiter:
                outcomes[i] = await collect(await core.submit(batch[i]))

        async with trio.open_nursery() as nursery:
            for i in range(len(batch)):
                nursery.start_soon(one, i)
        stats = core.statistics()
        kept = core.cache.statistics() if cache else None
    return outcomes, stats, kept


def same(drafted, plain) -> None:
    for i, (d, p) in enumerate(zip(drafted, plain, strict=True)):
        assert (d.tokens, d.text, d.last) == (p.tokens, p.text, p.last), i
        for a, b in zip((e for e in d.events if isinstance(e, TokenEvent)),
                        (e for e in p.events if isinstance(e, TokenEvent)), strict=True):
            assert (a.logprob is None) == (b.logprob is None), i
            assert a.logprob is None or abs(a.logprob - b.logprob) <= 1e-5, i
            assert [t.token for t in a.top] == [t.token for t in b.top], i


SOURCES = {"ngram": (lambda f: NgramDrafter(), 8), "suffix": (lambda f: SuffixDrafter(), 3),
           "self": (lambda f: DraftModel(f[2]()), 5), "other model": (lambda f: DraftModel(f[3]()), 1)}


@pytest.mark.parametrize("at_once", [1, 8, 32])
@pytest.mark.parametrize("source", SOURCES)
async def test_drafted_equals_plain_for_every_source_family_and_concurrency(family, source, at_once):
    model = family[1]
    batch = requests(model.tokenizer)[: 16 if at_once == 1 else 32]
    plain, _, _ = await run(model, batch, at_once)
    make, most = SOURCES[source]
    drafted, stats, _ = await run(model, batch, at_once, make(family), most)
    same(drafted, plain)
    assert stats.drafts.pieces > 0 and stats.drafts.drafted > 0, stats.drafts


async def test_the_target_as_its_own_draft_model_has_every_greedy_draft_accepted_in_fewer_passes(family):
    model = family[1]
    batch = [Request(r.prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
             for r in requests(model.tokenizer)[:8]]
    plain, before, _ = await run(model, batch, 8)
    drafted, after, _ = await run(model, batch, 8, DraftModel(family[2]()), 5)
    same(drafted, plain)
    assert after.drafts.accepted == after.drafts.drafted > 0, after.drafts  # the same weights draw the same argmax
    assert after.passes < before.passes // 3


async def test_no_drafted_token_reaches_the_prompt_cache(family):
    model = family[1]
    batch = requests(model.tokenizer)[:16]
    _, _, kept = await run(model, batch, 8, DraftModel(family[2]()), 5, cache=True)
    plain_kept = (await run(model, batch, 8, cache=True))[2]
    assert (kept.entries, kept.held_bytes) == (plain_kept.entries, plain_kept.held_bytes)  # the prompts' blocks only


@pytest.mark.skipif(unavailable_reason() is not None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("source", ["ngram", "self"])
async def test_on_gguf_blocks_drafted_logprobs_are_the_plain_ones_bit_for_bit(source, tmp_path):
    """Our CPU kernels (GGUF products, paged attention) compute a row alike whatever shares its pass."""
    hf = tiny.build("llama", tmp_path / "hf", max_position_embeddings=512)
    path = tmp_path / "tiny.gguf"
    tiny_gguf.write(hf, tmp_path / "hf", path, "llama", gguf.GGMLQuantizationType.Q8_0)
    load = lambda: load_model(path, choose("cpu", "fp32"), kv_blocks=LANES * 12, quiet=True)  # noqa: E731
    model = load()
    assert model.weights_census().tensors.get("Q8_0", 0) > 0
    batch = requests(model.tokenizer)
    plain, _, _ = await run(model, batch, 32)
    alone, _, _ = await run(model, batch[:6], 1)
    drafts = NgramDrafter() if source == "ngram" else DraftModel(load())
    drafted, stats, _ = await run(model, batch, 32, drafts, 8)
    assert stats.drafts.accepted > 0, stats.drafts
    for mine, theirs in ((drafted, plain), (alone, plain[:6])):
        for d, p in zip(mine, theirs):
            assert d.tokens == p.tokens and d.text == p.text
            assert [e.logprob for e in d.events if isinstance(e, TokenEvent)] == \
                [e.logprob for e in p.events if isinstance(e, TokenEvent)]
