"""A live server in the test's own nursery: the runtime on 127.0.0.1 port 0, torn down and checked after,
and ways to wait on its state without sleeping."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio
import trio.testing

from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner
from lanes.grammar.engine import GrammarEngine
from lanes.http.service import Service
from lanes.runtime import Runtime


def torch_service(model, *, lanes: int = 4, max_rows: int = 64, max_queue: int = 64, max_model_len: int = 256, **options) -> Service:
    stop_ids = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    grammars = GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, stop_ids)
    options.setdefault("grammars", grammars)
    backend = TorchBackend(model, CpuRunner(), lanes=lanes, max_model_len=max_model_len, grammars=grammars.matcher)
    core = LaneCore(backend, text_factory(model.tokenizer), stop_ids, max_rows=max_rows, max_queue=max_queue)
    return Service(core, model.tokenizer, "tiny", model.config.family, max_model_len, vocab_size=model.config.vocab_size,
                   **options)


@asynccontextmanager
async def serving(service: Service, grace: float = 5.0):
    """Yields the base URL; on exit the server shuts down and the lane core's and the decode gate's books must
    balance."""
    runtime = Runtime(service, host="127.0.0.1", port=0, grace=grace)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            listening = await nursery.start(runtime.run)
            try:
                yield listening.url
            finally:
                runtime.request_stop()
    core = service.core
    core.check_integrity()
    assert core.pool.free == core.pool.total, core.pool.statistics()
    assert all(job is None for job in core.lanes)
    if service.vision_inputs is not None:  # nothing left reserved on the decode gate
        gate = service.vision_inputs.gate
        gate.check_integrity()
        assert (gate.statistics().held_bytes, gate.statistics().running, gate.statistics().waiting) == (0, 0, 0)


def client(url: str, **options):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=options.pop("api_key", "none"), max_retries=0, **options)


async def until(condition) -> None:
    """Return at a point where every task is blocked and `condition()` holds (the test's fail_after bounds it)."""
    await trio.testing.wait_all_tasks_blocked()
    while not condition():
        await trio.testing.wait_all_tasks_blocked()


def counted(service: Service, endpoint: str, status: int) -> float:
    """Requests to `endpoint` answered (or ended) with `status`, as /metrics counts them."""
    value = service.metrics.registry.get_sample_value("lanes_requests_total", {"model_name": service.model_name,
                                                                            "endpoint": endpoint, "status": str(status)})
    return value or 0.0
