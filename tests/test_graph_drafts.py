"""Drafted lanes' rows (1 + k a lane) in the fast step that the CUDA graphs capture: their logits equal the
general forward's, and a lane core whose passes take that step gives, with drafts, exactly the tokens it
gives without them, greedy and seeded.

Rules: tiny random models built here, fp32; on CUDA the graphs are captured (TorchBackend with
`draft_tokens`), on the CPU the same step runs uncaptured under Triton's interpreter (TRITON_INTERPRET=1),
else skips; logits within 1e-4; tokens, text and ends compared exactly, logprobs within 1e-5; the lane
core's books checked after every pass and the pool balanced.
"""

import os

import pytest
import torch
import trio

import tiny
from engine_helpers import Checked, collect, running
from lanes.core.blocks import BlockPool, BlockTable
from lanes.core.passes import Piece
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request, TokenEvent
from lanes.drafts.ngram import NgramDrafter
from lanes.gpu.device import CpuRunner, choose, cuda_device_count, runner_for

if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")
DEVICE = "cuda" if cuda_device_count() else "cpu"

from lanes.backend.torch_backend import TorchBackend, text_factory  # noqa: E402
from lanes.gpu.graphs import DecodeGraphs  # noqa: E402
from lanes.loader import load_model  # noqa: E402

LANES, DRAFT = 4, 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tmp_path_factory.mktemp("tiny-graph-drafts")
    tiny.build("qwen2", folder, max_position_embeddings=512)
    return load_model(folder, choose(DEVICE, "fp32"), kv_blocks=LANES * 16, quiet=True)


def test_drafted_rows_in_the_fast_step_equal_the_general_forward(model):
    graphs = DecodeGraphs(model.decoder, max_lanes=LANES, max_model_len=128, prompt_rows=40, draft_tokens=DRAFT)
    assert graphs.max_logits == LANES * (1 + DRAFT)
    pool = BlockPool(model.kv_blocks)
    tables = [BlockTable(("lane", i)) for i in range(3)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (7, 20, 33)]
    for table, prompt in zip(tables, prompts):
        table.reserve(pool, len(prompt) + 1 + DRAFT)
    model.decoder.forward([Piece(i, tuple(p), 0, tuple(t.blocks)) for i, (p, t) in enumerate(zip(prompts, tables))])
    drafts = [(3, 1, 4, 1), (), (5, 9)]  # a lane drafting 4, one decoding, one drafting 2 (over a block's edge)
    pieces = [Piece(i, (p[-1] % 50, *d), len(p), tuple(t.blocks), "all" if d else "last")
              for i, (p, d, t) in enumerate(zip(prompts, drafts, tables))]
    assert graphs.fits(pieces)
    fast, drawn = graphs.run(pieces)
    assert fast.shape == (5 + 1 + 3, model.config.vocab_size)
    assert drawn is None  # not captured here: the caller draws
    eager = model.decoder.forward(pieces).float()
    torch.testing.assert_close(fast.float(), eager, rtol=0, atol=1e-4)
    assert graphs.passes == {"decode": 0, "prompt": 0, "drafted": 1}
    # more logit rows than the graphs hold: the general forward's
    assert graphs.fits([Piece(0, (1,) * 20, 0, tuple(tables[2].blocks), "all")])
    assert not graphs.fits([Piece(0, (1,) * 21, 0, tuple(tables[2].blocks), "all")])
    for t in tables:
        t.clear(pool)
    pool.check_integrity()


def graphed_backend(model) -> TorchBackend:
    """On CUDA the captured graphs; on the CPU the same step, uncaptured, for every pass that fits it."""
    if DEVICE == "cuda":
        backend = TorchBackend(model, runner_for(model.placement), lanes=LANES, max_model_len=256, draft_tokens=DRAFT)
        assert backend.graphs is not None and backend.graphs.feeds
        return backend
    backend = TorchBackend(model, CpuRunner(), lanes=LANES, max_model_len=256, draft_tokens=DRAFT)
    backend.graphs = DecodeGraphs(model.decoder, LANES, 48, 64, DRAFT)  # short tables: the interpreter's loops are short
    model.decoder.one_row_ready = False  # the interpreter takes ~30 s a one-row pass's GEMVs (tests/test_gemv.py has them)
    return backend


def requests(vocab: int) -> list[Request]:
    """Greedy and seeded, with and without logprobs; repeating prompts, the seeded ones pushed to repeat by a bias."""
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(4):
        base = torch.randint(3, vocab, (4,), generator=g).tolist()
        params = dict(max_tokens=12, ignore_eos=True, logprobs=i % 3 == 0)
        if i % 2:
            params.update(temperature=0.8, top_p=0.9, seed=100 + i)
        else:
            params.update(temperature=0)
        if i % 2:  # the greedy ones stay plain (their acceptance is read from the graph's draws)
            params.update(logit_bias=((base[0], 6.0),))
        out.append(Request(tuple(base * 3), SamplingParams(**params)))
    return out


async def outcomes(model, drafts, batch):
    backend = Checked(graphed_backend(model))
    options = dict(text=text_factory(model.tokenizer), stop_ids=model.tokenizer.eos_ids, drafts=drafts,
                   draft_tokens=DRAFT, draft_control=False)
    found = [None] * len(batch)
    with trio.fail_after(600):
        async with running(backend, **options) as core:
            backend.core = core

            async def one(i: int) -> None:
                found[i] = await collect(await core.submit(batch[i]))

            async with trio.open_nursery() as nursery:
                for i in range(len(batch)):
                    nursery.start_soon(one, i)
            stats = core.statistics()
    return found, stats, backend.inner.graphs.passes


@pytest.mark.parametrize("which", ["greedy alone", "greedy beside seeded"])
async def test_drafted_equals_plain_through_the_graphs_for_greedy_and_seeded_sampling(model, which):
    """Greedy lanes alone are accepted from the graph's own draws; beside seeded ones, every row is drawn."""
    batch = requests(model.config.vocab_size)
    batch = batch[::2] if which == "greedy alone" else batch
    plain, _, plain_passes = await outcomes(model, None, batch)
    drafted, stats, passes = await outcomes(model, NgramDrafter(), batch)
    assert plain_passes["drafted"] == 0 and passes["drafted"] > 0, passes
    assert stats.drafts.accepted > 0, stats.drafts
    for i, (d, p) in enumerate(zip(drafted, plain, strict=True)):
        assert (d.tokens, d.text, d.last) == (p.tokens, p.text, p.last), i
        for a, b in zip((e for e in d.events if isinstance(e, TokenEvent)),
                        (e for e in p.events if isinstance(e, TokenEvent)), strict=True):
            assert (a.logprob is None) == (b.logprob is None), i
            assert a.logprob is None or abs(a.logprob - b.logprob) <= 1e-5, i
