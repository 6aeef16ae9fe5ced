"""The lane core on a real (tiny) torch model: concurrent equals solo, seeded sampling reproducible,
logprobs against transformers, an event loop that never stalls, and wrappers that forward every entry.

Rules: tiny random models built in the test with transformers; fp32 on the CPU; exact token equality;
every I/O wait under `trio.fail_after`; `check_integrity()` on exit (the `running` helper).
"""

import gc
import inspect

import pytest
import torch
import trio

import tiny
from engine_helpers import collect, running
from lanes.core.backend import Backend, BackendWrapper
from lanes.followers import Followers, FollowersBackend
from lanes.core.metered import MeteredBackend
from lanes.core.sampling import SamplingParams
from lanes.core.stream import PromptLogprobs, Request, TokenEvent
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import choose, cuda_device_count, runner_for
from lanes.heap import freeze_startup_heap
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


@pytest.fixture(scope="module", params=DEVICES)
def moe_model(request, tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tmp_path_factory.mktemp("tiny-qwen2-moe")
    tiny.build("qwen2_moe", folder, num_hidden_layers=2, max_position_embeddings=256, num_experts=16, num_experts_per_tok=4)
    return load_model(folder, choose(request.param, "fp32"), kv_blocks=160, quiet=True)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
async def test_concurrent_streams_of_an_moe_family_equal_their_solo_runs(moe_model, kind):
    """A token's experts are its own: streams batched into shared passes route and decode as they do alone."""
    reqs = requests(moe_model.config.vocab_size, SAMPLINGS[kind])
    together, stats = await run_all(moe_model, reqs, lanes=5)
    assert stats.passes < sum(len(r.prompt) for r in reqs)
    for request, outcome in zip(reqs, together):
        (alone,), _ = await run_all(moe_model, [request], lanes=1)
        assert outcome.tokens == alone.tokens and len(outcome.tokens) == 10


class CountsFed(BackendWrapper):
    """Counts the plans whose tokens the device fed, as they go by."""

    fed = 0

    async def step(self, plan, started=None, following=None):
        self.fed += following is not None
        return await self.inner.step(plan, started, following)


async def test_fed_passes_give_the_tokens_of_passes_fed_from_the_host(tiny_model):
    """On CUDA with graphs, decode passes are queued behind the running one and read their tokens from
    its draws on the device; greedy streams (ending by length and by stop tokens) get the same tokens as
    with every pass fed from the host (no graphs). On the CPU nothing feeds."""
    model, _ = tiny_model
    eos = model.tokenizer.eos_ids
    sampling = lambda i: SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=i % 3 == 0)  # noqa: E731
    reqs = requests(model.config.vocab_size, sampling)
    counted = []

    def wrap(backend):
        counted.append(CountsFed(backend))
        return counted[0]

    fed, _ = await run_all(model, reqs, lanes=5, wrap=wrap)
    backend = TorchBackend(model, runner_for(model.placement), lanes=5, max_model_len=256, graphs=False)
    assert not backend.shape.feeds
    async with running(backend, text=text_factory(model.tokenizer), stop_ids=eos, max_rows=32) as core:
        with trio.fail_after(120):
            streams = [await core.submit(r) for r in reqs]
            host = [await collect(s) for s in streams]
    assert [o.tokens for o in fed] == [o.tokens for o in host]
    assert [o.last for o in fed] == [o.last for o in host]
    assert (counted[0].fed > 20) == model.placement.is_cuda and counted[0].inner.shape.feeds == model.placement.is_cuda


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

    freeze_startup_heap()  # as `lanes serve` does: a full collection of the suite's heap is not the lane core's
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await run_all(model, reqs, lanes=6, wrap=wrap)
            nursery.cancel_scope.cancel()
    finally:
        gc.unfreeze()
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

    found, todo = [BackendWrapper], [BackendWrapper]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def protocol_members() -> dict[str, object]:
    """Every public member of the `Backend` protocol (and of protocols it extends), by name."""
    members = {}
    for cls in reversed(Backend.__mro__):
        if cls.__module__ not in ("builtins", "typing"):
            members.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
    return members


class Token:
    """A unique stand-in for an argument or a result, named for the failure message."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def recording_backend(calls: list) -> object:
    """A backend built from the protocol itself: each entry records its arguments (bound to the protocol's
    signature, defaults applied) and returns a Token of its own, or None where the protocol returns None."""
    namespace = {}
    for name, member in protocol_members().items():
        if isinstance(member, property):
            namespace[name] = property(lambda self, name=name: calls.append((name, {})) or RESULTS[name])
            continue
        signature = inspect.signature(member)

        def arguments(args, kwargs, signature=signature):
            bound = signature.bind(None, *args, **kwargs)
            bound.apply_defaults()
            return dict(list(bound.arguments.items())[1:])  # without self

        if inspect.iscoroutinefunction(member):
            async def entry(self, *args, name=name, arguments=arguments, **kwargs):
                calls.append((name, arguments(args, kwargs)))
                return RESULTS[name]
        else:
            def entry(self, *args, name=name, arguments=arguments, **kwargs):
                calls.append((name, arguments(args, kwargs)))
                return RESULTS[name]
        namespace[name] = entry
    return type("Recording", (), namespace)()


def returns_none(member) -> bool:
    return inspect.signature(member).return_annotation in (None, "None")  # postponed annotations are strings


RESULTS = {name: None if not isinstance(m, property) and returns_none(m) else Token(f"{name} result")
           for name, m in protocol_members().items()}


def test_the_protocol_walk_finds_every_entry_and_every_wrapper():
    assert set(protocol_members()) >= {"shape", "step", "bind", "unbind", "aclose"}
    names = {w.__name__ for w in wrappers()}
    assert names >= {"BackendWrapper", "MeteredBackend", "FollowersBackend", "LosesDevice"}


@pytest.mark.parametrize("wrapper", wrappers(), ids=lambda w: w.__name__)
async def test_every_entry_of_the_backend_protocol_is_forwarded(wrapper):
    calls, sent, given = [], [], {}
    inner = recording_backend(calls)
    outer = wrapper(inner, Followers(Sent(sent), 2)) if wrapper is FollowersBackend else wrapper(inner)
    for name, member in protocol_members().items():
        calls.clear()
        if isinstance(member, property):
            assert getattr(outer, name) is RESULTS[name], name
            assert calls == [(name, {})]
            continue
        assert callable(getattr(wrapper, name, None)), f"{wrapper.__name__} has no {name}"
        params = list(inspect.signature(member).parameters.values())[1:]
        args = {p.name: Token(f"{name}.{p.name}") for p in params}
        mine = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(wrapper, name)).parameters.values()][1:]
        assert mine == [(p.name, p.kind, p.default) for p in params], f"{wrapper.__name__}.{name} has another signature"
        assert inspect.iscoroutinefunction(getattr(wrapper, name)) == inspect.iscoroutinefunction(member), name
        result = getattr(outer, name)(*args.values())  # positionally, as the lane core calls
        if inspect.iscoroutinefunction(member):
            result = await result
        assert result is RESULTS[name], f"{wrapper.__name__}.{name} did not return the inner result"
        assert calls == [(name, args)], f"{wrapper.__name__}.{name} forwarded {calls}"
        given[name] = args
    # the followers hear of the pass (and of the one to follow it) before it runs; no other wrapper sends anything
    step = given["step"]
    assert sent == ([step["plan"], step["following"]] if wrapper is FollowersBackend else [])
