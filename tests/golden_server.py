"""Bad requests and their frozen answers (tests/golden/errors.json), run against a live server.

`python tests/golden_server.py --record` rewrites the answers from a live server (review the diff before
committing: the answers are the server's frozen words).
"""

from __future__ import annotations

import json
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).parent))

from engine_helpers import Gated  # noqa: E402
from lanes.core.fake import EOS, fake_text  # noqa: E402
from lanes.core.lane_core import LaneCore  # noqa: E402
from lanes.http.service import Service  # noqa: E402
from lanes.text.tokenizer import Tokenizer  # noqa: E402
from server_helpers import serving  # noqa: E402
from tiny import write_tokenizer  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "errors.json"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
MAX_BODY = 64 << 10

# name -> (server setup, method, path, body: raw string or JSON value, headers)
CASES = {
    "malformed-json": ("plain", "POST", CHAT, "{bad json", {}),
    "body-not-an-object": ("plain", "POST", CHAT, [1, 2], {}),
    "messages-missing": ("plain", "POST", CHAT, {"model": "tiny"}, {}),
    "messages-wrong-type": ("plain", "POST", CHAT, {"messages": "hello"}, {}),
    "temperature-wrong-type": ("plain", "POST", CHAT, {"messages": HELLO, "temperature": "hot"}, {}),
    "temperature-out-of-range": ("plain", "POST", CHAT, {"messages": HELLO, "temperature": 3}, {}),
    "max-tokens-wrong-type": ("plain", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, {}),
    "unknown-model": ("plain", "POST", CHAT, {"model": "gpt-9", "messages": HELLO}, {}),
    "max-tokens-too-large": ("plain", "POST", CHAT, {"messages": HELLO, "max_tokens": 100000}, {}),
    "prompt-past-the-context": ("plain", "POST", "/v1/completions", {"prompt": "word " * 100, "max_tokens": 4}, {}),
    "too-many-stop-strings": ("plain", "POST", CHAT, {"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, {}),
    "n-zero": ("plain", "POST", CHAT, {"messages": HELLO, "n": 0}, {}),
    "n-too-large": ("plain", "POST", CHAT, {"messages": HELLO, "n": 17}, {}),
    "top-logprobs-without-logprobs": ("plain", "POST", CHAT, {"messages": HELLO, "top_logprobs": 3}, {}),
    "completions-logprobs-out-of-range": ("plain", "POST", "/v1/completions", {"prompt": "hi", "logprobs": 9}, {}),
    "prompt-token-out-of-range": ("plain", "POST", "/v1/completions", {"prompt": [1, 2, 999999]}, {}),
    "body-over-the-limit": ("plain", "POST", CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}, {}),
    "unsupported-parameter": ("plain", "POST", CHAT, {"messages": HELLO, "logit_bias": {"1": 5}}, {}),
    "unknown-parameter": ("plain", "POST", CHAT, {"messages": HELLO, "frobnicate": True}, {}),
    "image-without-vision": ("plain", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, {}),
    "decisions-without-decider": ("plain", "POST", "/v1/decisions", {"input": "x", "questions": []}, {}),
    "systemone-without-decider": ("plain", "POST", "/v1/systemone", {"input": "x"}, {}),
    "no-such-endpoint": ("plain", "GET", "/v1/nothing", None, {}),
    "method-not-allowed": ("plain", "GET", CHAT, None, {}),
    "detokenize-wrong-type": ("plain", "POST", "/v1/detokenize", {"tokens": "abc"}, {}),
    "missing-api-key": ("api-key", "POST", CHAT, {"messages": HELLO}, {}),
    "wrong-api-key": ("api-key", "POST", CHAT, {"messages": HELLO}, {"Authorization": "Bearer nope"}),
    "queue-full": ("queue-full", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
    "headers-over-the-limit": ("plain", "POST", CHAT, {"messages": HELLO}, {"X-Padding": "x" * 20000}),
    "too-many-open-requests": ("open-full", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
    "shutting-down": ("shutting-down", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
}


def tokenizer(folder: Path) -> Tokenizer:
    vocab = write_tokenizer(folder)
    return Tokenizer.from_folder(folder, vocab)


def fake_service(folder: Path, **options) -> tuple[Service, Gated]:
    backend = Gated(lanes=options.pop("lanes", 2), blocks=64, max_model_len=64)
    core = LaneCore(backend, fake_text, [EOS], max_queue=options.pop("max_queue", 8))
    return Service(core, tokenizer(folder), "tiny", "fake", 64, max_body=MAX_BODY, **options), backend


async def send(http: httpx.AsyncClient, method: str, path: str, body, headers: dict) -> httpx.Response:
    if body is None:
        return await http.request(method, path, headers=headers)
    content = body if isinstance(body, str) else json.dumps(body)
    return await http.request(method, path, content=content, headers={"Content-Type": "application/json", **headers})


@asynccontextmanager
async def setup(kind: str, folder: Path):
    """A live server in the state a case needs; yields an HTTP client on it."""
    if kind == "api-key":
        service, backend = fake_service(folder, api_key="s3cret")
    elif kind == "queue-full":
        service, backend = fake_service(folder, lanes=1, max_queue=0)
    elif kind == "open-full":
        service, backend = fake_service(folder, max_open=1)
    else:
        service, backend = fake_service(folder)
    async with serving(service, grace=30) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            if kind in ("queue-full", "shutting-down", "open-full"):
                entered, release = backend.hold()
                async with trio.open_nursery() as nursery:
                    # A stream holds the (only) lane inside a held pass.
                    nursery.start_soon(send, http, "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {})
                    await entered.wait()
                    if kind == "shutting-down":
                        service.core.begin_shutdown(30)  # queued in the mailbox before the case's request
                    yield http
                    release.set()
            else:
                yield http


async def answers(folder: Path) -> dict:
    out = {}
    for kind in dict.fromkeys(case[0] for case in CASES.values()):
        async with setup(kind, folder) as http:
            for name, (case_kind, method, path, body, headers) in CASES.items():
                if case_kind != kind:
                    continue
                response = await send(http, method, path, body, headers)
                out[name] = {"status": response.status_code, "retry_after": response.headers.get("Retry-After"),
                             "body": response.json()}
                if kind != "shutting-down":
                    health = await http.get("/health")
                    assert health.status_code == 200, name
    return out


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        recorded = trio.run(answers, Path(tmp))
    GOLDEN.write_text(json.dumps(recorded, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {len(recorded)} answers to {GOLDEN}")
