"""The lane core on a real (tiny) torch model: concurrent equals solo, seeded sampling reproducible,
logprobs against transformers, an event loop that never stalls, and wrappers that forward every entry.

Rules: tiny random models built in the test with transformers; fp32 on the CPU; exact token equality;
every I/O wait under `trio.fail_after`; `check_integrity()` on exit (the `running` helper).
"""

import inspect

import pytest
import torch
import trio

import tiny
from engine_helpers import collect, running
from lanes.core.backend import BACKEND_ENTRIES, Backend, BackendWrapper
from lanes.followers import Followers, FollowersBackend
from lanes.core.metered import MeteredBackend
from lanes.core.sampling import SamplingParams
from lanes.core.stream import PromptLogprobs, Request, TokenEvent
from lanes.core.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import choose, cuda_device_count, runner_for
from lanes.loader import load_model


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device"))]


@pytest.fixture(scope="module", params=DEVICES)
def tiny_model(request, tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny.build("llama", folder, num_hidden_layers=2, max_position_embeddings=256)
    model = load_model(folder, choose(request.param, "fp32"), kv_blocks=160, quiet=True)
    return model, reference


def requests(vocab: int, sampling) -> list[Request]:
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 17, 40, 1, 9, 33, 5, 21, 2, 50, 12, 8]
    return [Request(tuple(torch.randint(0, vocab, (n,), generator=generator).tolist()), sampling(i)) for i, n in enumerate(lengths)]


async def run_all(model, reqs, *, lanes, max_rows=32, wrap=None):
    backend = TorchBackend(model, runner_for(model.placement), lanes=lanes, max_model_len=256)
    backend = wrap(backend) if wrap else backend
    async with running(backend, text=text_factory(model.tokenizer), stop_ids=model.tokenizer.eos_ids, max_rows=max_rows) as core:
        with trio.fail_after(120):
            streams = [await core.submit(r) for r in reqs]
            return [await collect(s) for s in streams], core.statistics()


SAMPLINGS = {
    "greedy": lambda i: SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    "seeded": lambda i: SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i, max_tokens=10, ignore_eos=True),
    "penalties": lambda i: SamplingParams(temperature=0.7 if i % 2 else 0, seed=i, repetition_penalty=1.3, presence_penalty=0.5,
                                          frequency_penalty=0.4, max_tokens=10, ignore_eos=True),
}


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
async def test_twelve_concurrent_streams_equal_their_solo_runs(tiny_model, kind):
    model, _ = tiny_model
    reqs = requests(model.config.vocab_size, SAMPLINGS[kind])
    together, stats = await run_all(model, reqs, lanes=5)
    assert stats.passes < sum(len(r.prompt) for r in reqs)  # the streams really shared passes
    for request, outcome in zip(reqs, together):
        (alone,), _ = await run_all(model, [request], lanes=1)
        assert outcome.tokens == alone.tokens
        assert len(outcome.tokens) == 10
    if kind != "greedy":
        again, _ = await run_all(model, reqs, lanes=3, max_rows=16)
        assert [o.tokens for o in again] == [o.tokens for o in together]


async def test_logprobs_and_prompt_logprobs_equal_transformers(tiny_model):
    model, reference = tiny_model
    prompt = tuple(range(5, 29))
    sampling = SamplingParams(temperature=0, max_tokens=4, logprobs=True, top_logprobs=3, prompt_logprobs=True, ignore_eos=True)
    (outcome,), _ = await run_all(model, [Request(prompt, sampling)], lanes=2, max_rows=10)
    events = outcome.events
    assert isinstance(events[0], PromptLogprobs)
    with torch.no_grad():
        full = reference(torch.tensor([list(prompt) + outcome.tokens])).logits[0].log_softmax(-1)
    expected_prompt = [full[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert events[0].logprobs[0] is None
    assert events[0].logprobs[1:] == pytest.approx(expected_prompt, abs=1e-4)
    assert [t.token for t in events[0].top[5]] == full[4].topk(3).indices.tolist()
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    for k, event in enumerate(tokens):
        row = full[len(prompt) - 1 + k]
        assert event.logprob == pytest.approx(row[event.token].item(), abs=1e-4)
        assert [t.token for t in event.top] == row.topk(3).indices.tolist()
        assert [t.logprob for t in event.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


async def test_the_event_loop_never_waits_more_than_one_pass(tiny_model):
    model, _ = tiny_model
    reqs = requests(model.config.vocab_size, lambda i: SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    late = []
    metered: list[MeteredBackend] = []

    def wrap(backend):
        metered.append(MeteredBackend(backend))
        return metered[0]

    async def ticker():
        while True:
            due = trio.current_time() + 0.002  # often enough to be sampled many times even when the GPU takes 1 ms a pass
            await trio.sleep_until(due)
            late.append(trio.current_time() - due)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await run_all(model, reqs, lanes=6, wrap=wrap)
        nursery.cancel_scope.cancel()
    times = metered[0].statistics()
    assert times.passes > 60 and len(late) > 10
    assert max(late) <= times.seconds_max  # never late by more than one pass


class Sent:
    """A control channel that records what rank 0 broadcasts."""

    def __init__(self, into: list) -> None:
        self.send = into.append


def wrappers() -> list[type]:
    import fuzz.run  # noqa: F401  (every module that defines a wrapper)
    import lanes.core.metered  # noqa: F401
    import lanes.followers  # noqa: F401

    found, todo = [], [BackendWrapper]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


@pytest.mark.parametrize("wrapper", wrappers(), ids=lambda w: w.__name__)
async def test_every_entry_of_the_backend_protocol_is_forwarded(wrapper):
    members = {name for name in dir(Backend) if not name.startswith("_")}
    assert members == set(BACKEND_ENTRIES)
    calls = []

    class Inner:
        shape = "the shape"

        async def step(self, plan, started=None):
            calls.append(("step", plan))
            return "result"

        def bind(self, lane, prompt, sampling):
            calls.append(("bind", lane, prompt, sampling))

        def unbind(self, lane):
            calls.append(("unbind", lane))

        async def aclose(self):
            calls.append(("aclose",))

    sent = []
    outer = wrapper(Inner(), Followers(Sent(sent), 2)) if wrapper is FollowersBackend else wrapper(Inner())
    assert outer.shape == "the shape"
    assert await outer.step("plan") == "result"
    outer.bind(3, (1, 2), "params")
    outer.unbind(3)
    await outer.aclose()
    assert calls == [("step", "plan"), ("bind", 3, (1, 2), "params"), ("unbind", 3), ("aclose",)]
    assert sent == (["plan"] if wrapper is FollowersBackend else [])  # the followers hear of the pass first
    for name in BACKEND_ENTRIES:
        assert inspect.iscoroutinefunction(getattr(Backend, name, None)) == inspect.iscoroutinefunction(getattr(wrapper, name, None))
