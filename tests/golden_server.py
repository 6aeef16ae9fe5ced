"""Bad requests and their frozen answers (tests/golden/errors.json), run against a live server.

`python tests/golden_server.py --record` rewrites the answers from a live server (review the diff before
committing: the answers are the server's frozen words).
"""

from __future__ import annotations

import base64
import io
import json
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from engine_helpers import Gated  # noqa: E402
from lanes.core.fake import EOS, fake_text  # noqa: E402
from lanes.core.lane_core import LaneCore  # noqa: E402
from lanes.families.qwen2_vl import VisionTokens  # noqa: E402
from lanes.grammar.engine import GrammarEngine  # noqa: E402
from lanes.http.decode_gate import DecodeGate  # noqa: E402
from lanes.http.media_fetch import MediaFetcher  # noqa: E402
from lanes.http.service import Service  # noqa: E402
from lanes.http.vision_inputs import VisionInputs  # noqa: E402
from lanes.text.tokenizer import Tokenizer  # noqa: E402
from mp4_boxes import find, make_mp4, patched, random_clip  # noqa: E402
from server_helpers import serving  # noqa: E402
from tiny import CHATML, write_tokenizer  # noqa: E402
from tiny_vl import write_vl_tokenizer  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "errors.json"
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
MAX_BODY = 64 << 10
ASK = [{"type": "predicate", "instructions": "Is it?"}]
NESTED = json.loads("[" * 200 + "]" * 200)  # parses, but past the server's bound on nesting
PAD = 270  # the vision setup's image placeholder id (tiny_vl's tokenizer without labels; checked in setup)


def image_data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def picture(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 40, 90)).save(out, format=fmt)
    return out.getvalue()


def with_image(url: str, kind: str = "image_url") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": kind, kind: {"url": url}}]}], "max_tokens": 2}


def decision_image(url: str, role: str = "user") -> dict:
    return {"model": "tiny", "questions": ASK, "input": [{"role": role, "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": url}]}]}


def asset_state(key: str, data: str, fmt: str = "png", state: str = "see the photo") -> dict:
    return {"state": state, "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
            "assets": {key: {"type": "image", "format": fmt, "data_base64": data}}}


def with_parts(*urls: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]}],
            "max_tokens": 2}


def flat_png(width: int, height: int) -> bytes:
    """One colour: a large image in a few kB."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def lying_mp4(lie: str) -> bytes:
    """A 4-frame fragmented mp4 whose trun declares 0x5000000 samples, or whose sample entry names no codec."""
    data = make_mp4(random_clip(4, 16, 16), options={"movflags": "frag_keyframe+empty_moov"})
    if lie == "trun":
        return patched(data, find(data, "moof/traf/trun")[0] + 12, 0x5000000)
    return patched(data, find(data, "moov/trak/mdia/minf/stbl/stsd")[0] + 20, int.from_bytes(b"zzzz", "big"))


def many_assets(count: int) -> dict:
    state = " ".join(f"photo{i}" for i in range(count))
    data = base64.b64encode(picture("PNG")).decode()
    return {"state": state, "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
            "assets": {f"photo{i}": {"type": "image", "format": "png", "data_base64": data} for i in range(count)}}


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
    "unsupported-parameter": ("plain", "POST", CHAT, {"messages": HELLO, "prediction": {"type": "content", "content": "x"}}, {}),
    "unknown-parameter": ("plain", "POST", CHAT, {"messages": HELLO, "frobnicate": True}, {}),
    "image-without-vision": ("plain", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, {}),
    "decisions-without-decider": ("plain", "POST", "/v1/decisions", {"input": "x", "questions": []}, {}),
    "systemone-without-decider": ("plain", "POST", "/v1/systemone", {"input": "x"}, {}),
    "no-such-endpoint": ("plain", "GET", "/v1/nothing", None, {}),
    "unknown-model-by-id": ("plain", "GET", "/v1/models/gpt-9", None, {}),
    "tokenize-past-max-open": ("open-full", "POST", "/v1/tokenize", {"prompt": "hello"}, {}),
    "root-tokenize-prompt-wrong-type": ("plain", "POST", "/tokenize", {"prompt": 5}, {}),
    "root-detokenize-wrong-type": ("plain", "POST", "/detokenize", {"tokens": "12"}, {}),
    "request-not-http": ("plain", "RAW", "", b"GARBAGE / NOT-HTTP\r\n\r\n", {}),
    "content-length-not-a-number": ("plain", "RAW", "", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
                                    b"Content-Length: ten\r\n\r\n", {}),
    "body-too-slow": ("slow-body", "RAW", "", b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 40\r\n"
                      b"\r\n{\"prompt\": ", {}),
    "method-not-allowed": ("plain", "GET", CHAT, None, {}),
    "detokenize-wrong-type": ("plain", "POST", "/v1/detokenize", {"tokens": "abc"}, {}),
    "missing-api-key": ("api-key", "POST", CHAT, {"messages": HELLO}, {}),
    "wrong-api-key": ("api-key", "POST", CHAT, {"messages": HELLO}, {"Authorization": "Bearer nope"}),
    "queue-full": ("queue-full", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
    "headers-over-the-limit": ("plain", "POST", CHAT, {"messages": HELLO}, {"X-Padding": "x" * 20000}),
    "too-many-open-requests": ("open-full", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
    "shutting-down": ("shutting-down", "POST", CHAT, {"messages": HELLO, "max_tokens": 2}, {}),
    "body-nested-too-deeply": ("plain", "POST", CHAT, "[" * 30000 + "]" * 30000, {}),
    "body-nested-past-the-limit": ("plain", "POST", "/v1/completions", {"prompt": "hi", "user": NESTED}, {}),
    "content-not-unicode": ("plain", "POST", CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', {}),
    "prompt-not-unicode": ("plain", "POST", "/v1/completions", '{"prompt": ["fine", "x\\udc00"]}', {}),
    "key-not-unicode": ("plain", "POST", "/v1/tokenize", '{"prompt": "hi", "x\\ud800": 1}', {}),
    "decision-input-not-unicode": ("decider", "POST", "/v1/decisions",
                                   '{"model": "tiny", "input": "\\ud800", "questions": ' + json.dumps(ASK) + "}", {}),
    "systemone-state-not-unicode": ("decider", "POST", "/v1/systemone",
                                    '{"state": {"note": "\\udfff"}, "questions": {"q": {"type": "noul", "instructions": "?"}}}', {}),
    "decision-past-the-context": ("decider", "POST", "/v1/decisions", {"model": "tiny", "input": "word " * 100,
                                                                       "questions": ASK}, {}),
    "systemone-past-the-context": ("decider", "POST", "/v1/systemone", {"state": "word " * 100, "questions": {
        "q": {"type": "noul", "instructions": "Is it?"}}}, {}),
    "image-data-url-not-base64": ("vision", "POST", CHAT, with_image("data:image/png;base64,@@@@"), {}),
    "image-url-without-vision-urls": ("vision", "POST", CHAT, with_image("https://example.com/cat.png"), {}),
    "image-url-not-https": ("vision", "POST", CHAT, with_image("http://example.com/cat.png"), {}),
    "image-not-an-image": ("vision", "POST", CHAT, with_image(image_data_url(b"certainly not a picture")), {}),
    "image-truncated": ("vision", "POST", CHAT, with_image(image_data_url(picture("PNG")[:60])), {}),
    "image-gif": ("vision", "POST", CHAT, with_image(image_data_url(picture("GIF"), "image/png")), {}),
    "image-data-url-wrong-type": ("vision", "POST", CHAT, with_image(image_data_url(picture("PNG"), "text/plain")), {}),
    "video-not-a-video": ("vision", "POST", CHAT, with_image(image_data_url(b"no frames here", "video/mp4"), "video_url"), {}),
    "image-url-plain-http": ("vision-urls", "POST", CHAT, with_image("http://example.com/cat.png"), {}),
    "image-url-loopback": ("vision-urls", "POST", CHAT, with_image("https://127.0.0.1/cat.png"), {}),
    "image-url-metadata-address": ("vision-urls", "POST", CHAT, with_image("https://169.254.169.254/latest"), {}),
    "audio-part": ("vision", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, {}),
    "images-placeholders-mismatch": ("vision", "POST", "/v1/completions", {
        "prompt": [5, PAD, 6, PAD, 7], "images": [image_data_url(picture("PNG"))], "max_tokens": 2}, {}),
    "images-without-vision": ("plain", "POST", "/v1/completions", {"prompt": "hi", "images": ["data:image/png;base64,AA=="]}, {}),
    "decision-image-without-vision": ("decider", "POST", "/v1/decisions", decision_image("data:image/png;base64,AA=="), {}),
    "systemone-asset-without-vision": ("decider", "POST", "/v1/systemone", asset_state("photo", "AA=="), {}),
    "prompt-empty": ("plain", "POST", "/v1/completions", {"prompt": ""}, {}),
    "prompt-list-with-an-empty-one": ("plain", "POST", "/v1/completions", {"prompt": ["hi", ""], "max_tokens": 2}, {}),
    "role-unknown": ("plain", "POST", CHAT, {"messages": [{"role": "hacker", "content": "hi"}]}, {}),
    "user-message-without-content": ("plain", "POST", CHAT, {"messages": [{"role": "user"}]}, {}),
    "assistant-message-without-content-or-tool-calls": ("plain", "POST", CHAT, {"messages": HELLO + [{"role": "assistant"}]}, {}),
    "tools-not-objects": ("plain", "POST", CHAT, {"messages": HELLO, "tools": [1]}, {}),
    "tool-without-a-function": ("plain", "POST", CHAT, {"messages": HELLO, "tools": [{"type": "function"}]}, {}),
    "tool-without-a-name": ("plain", "POST", CHAT, {"messages": HELLO, "tools": [
        {"type": "function", "function": {"description": "no name", "parameters": {}}}]}, {}),
    "tool-parameters-not-an-object": ("plain", "POST", CHAT, {"messages": HELLO, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": "x"}}]}, {}),
    "tool-type-not-function": ("plain", "POST", CHAT, {"messages": HELLO, "tools": [
        {"type": "web_search", "function": {"name": "f"}}]}, {}),
    "user-not-a-string": ("plain", "POST", CHAT, {"messages": HELLO, "user": 7}, {}),
    "schema-keyword-not-enforced": ("plain", "POST", CHAT, {"messages": HELLO, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"not": {"type": "string"}}}}}, {}),
    "tool-schema-keyword-not-enforced": ("plain", "POST", CHAT, {"messages": HELLO, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]}, {}),
    "response-format-type-unknown": ("plain", "POST", CHAT, {"messages": HELLO, "response_format": {"type": "yaml"}}, {}),
    "response-format-without-schema": ("plain", "POST", CHAT, {"messages": HELLO, "response_format": {"type": "json_schema"}}, {}),
    "guided-regex-invalid": ("plain", "POST", "/v1/completions", {"prompt": "hi", "guided_regex": "[a-"}, {}),
    "guided-grammar-invalid": ("plain", "POST", CHAT, {"messages": HELLO, "guided_grammar": "start: ("}, {}),
    "guided-choice-empty": ("plain", "POST", CHAT, {"messages": HELLO, "guided_choice": []}, {}),
    "structured-outputs-unknown-key": ("plain", "POST", CHAT, {"messages": HELLO, "structured_outputs": {"yaml": "x"}}, {}),
    "two-constraints": ("plain", "POST", CHAT, {"messages": HELLO, "guided_regex": "a+", "response_format": {
        "type": "json_object"}}, {}),
    "response-format-beside-tools": ("plain", "POST", CHAT, {"messages": HELLO, "response_format": {"type": "json_object"},
                                                            "tools": [{"type": "function", "function": {"name": "f"}}]}, {}),
    "tool-choice-required-without-tools": ("plain", "POST", CHAT, {"messages": HELLO, "tool_choice": "required"}, {}),
    "tool-choice-unknown-function": ("plain", "POST", CHAT, {"messages": HELLO, "tool_choice": {
        "type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}, {}),
    "tool-choice-unknown-word": ("plain", "POST", CHAT, {"messages": HELLO, "tool_choice": "always"}, {}),
    "parallel-tool-calls-wrong-type": ("plain", "POST", CHAT, {"messages": HELLO, "parallel_tool_calls": "yes"}, {}),
    "grammar-with-ignore-eos": ("plain", "POST", CHAT, {"messages": HELLO, "guided_choice": ["a"], "ignore_eos": True}, {}),
    "responses-input-missing": ("plain", "POST", "/v1/responses", {"model": "tiny"}, {}),
    "responses-unknown-previous": ("plain", "POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_x"}, {}),
    "responses-reasoning": ("plain", "POST", "/v1/responses", {"input": "hi", "reasoning": {"effort": "high"}}, {}),
    "responses-hosted-tool": ("plain", "POST", "/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}, {}),
    "logit-bias-not-an-object": ("plain", "POST", CHAT, {"messages": HELLO, "logit_bias": [1, 2]}, {}),
    "logit-bias-key-not-a-token-id": ("plain", "POST", CHAT, {"messages": HELLO, "logit_bias": {"hello": 1}}, {}),
    "logit-bias-value-out-of-range": ("plain", "POST", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, {}),
    "logit-bias-value-not-a-number": ("plain", "POST", CHAT, {"messages": HELLO, "logit_bias": {"5": "up"}}, {}),
    "logit-bias-token-outside-the-vocabulary": ("plain", "POST", CHAT, {"messages": HELLO, "logit_bias": {"99999": 1}}, {}),
    "stop-token-ids-wrong-type": ("plain", "POST", CHAT, {"messages": HELLO, "stop_token_ids": ["a"]}, {}),
    "stop-token-id-outside-the-vocabulary": ("plain", "POST", "/v1/completions", {"prompt": "hi", "stop_token_ids": [99999]}, {}),
    "min-tokens-above-max-tokens": ("plain", "POST", CHAT, {"messages": HELLO, "min_tokens": 5, "max_tokens": 2}, {}),
    "min-tokens-negative": ("plain", "POST", "/v1/completions", {"prompt": "hi", "min_tokens": -1}, {}),
    "skip-special-tokens-wrong-type": ("plain", "POST", CHAT, {"messages": HELLO, "skip_special_tokens": "no"}, {}),
    "max-tokens-zero-without-echo": ("plain", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, {}),
    "max-tokens-zero-in-chat": ("plain", "POST", CHAT, {"messages": HELLO, "max_tokens": 0}, {}),
    "continue-final-message-with-generation-prompt": ("plain", "POST", CHAT, {"messages": HELLO + [
        {"role": "assistant", "content": "The"}], "continue_final_message": True}, {}),
    "chat-template-kwargs-not-an-object": ("plain", "POST", CHAT, {"messages": HELLO, "chat_template_kwargs": "x"}, {}),
    "chat-template-kwargs-reserved-name": ("plain", "POST", CHAT, {"messages": HELLO,
                                                                   "chat_template_kwargs": {"tools": []}}, {}),
    "score-levels-with-duplicate-labels": ("decider", "POST", "/v1/decisions", {"model": "tiny", "input": "x", "questions": [
        {"type": "score", "instructions": "How much?", "levels": [{"label": "low"}, {"label": "high"}, {"label": "low"}]}]}, {}),
    "decision-image-in-a-system-message": ("vision-decider", "POST", "/v1/decisions",
                                           decision_image(image_data_url(picture("PNG")), "system"), {}),
    "decision-image-not-an-image": ("vision-decider", "POST", "/v1/decisions",
                                    decision_image(image_data_url(b"certainly not a picture")), {}),
    "systemone-asset-not-in-state": ("vision-decider", "POST", "/v1/systemone", asset_state("drawing", "AA=="), {}),
    "systemone-asset-wrong-format": ("vision-decider", "POST", "/v1/systemone", asset_state("photo", "AA==", "gif"), {}),
    "systemone-asset-not-base64": ("vision-decider", "POST", "/v1/systemone", asset_state("photo", "@@@@"), {}),
    "systemone-asset-not-an-image": ("vision-decider", "POST", "/v1/systemone",
                                     asset_state("photo", base64.b64encode(b"certainly not a picture").decode()), {}),
    "video-trun-bomb": ("vision", "POST", CHAT, with_image(image_data_url(lying_mp4("trun"), "video/mp4"), "video_url"), {}),
    "video-without-a-codec": ("vision", "POST", CHAT, with_image(image_data_url(lying_mp4("codec"), "video/mp4"),
                                                                 "video_url"), {}),
    "too-many-media-parts": ("vision", "POST", CHAT, with_parts(*[image_data_url(picture("PNG"))] * 17), {}),
    # its header alone says 2000 x 2000: ~1300 rows, over the 512 of the context, refused before it is decoded
    "images-past-the-context": ("vision", "POST", CHAT, with_image(image_data_url(flat_png(2000, 2000))), {}),
    "image-over-the-decode-budget": ("vision-small-budget", "POST", CHAT, with_image(image_data_url(flat_png(3000, 3000))), {}),
    "systemone-too-many-assets": ("vision-decider", "POST", "/v1/systemone", many_assets(17), {}),
}


def tokenizer(folder: Path, labels: bool = False, template: str = CHATML) -> Tokenizer:
    vocab = write_tokenizer(folder, chat_template=template, labels=labels)
    return Tokenizer.from_folder(folder, vocab)


def fake_service(folder: Path, **options) -> tuple[Service, Gated]:
    """A fake backend's server; `labels` gives its tokenizer single-token decision labels; `vision_urls` (True
    or False) makes it a --vision server, with the vision placeholders in its tokenizer."""
    length = options.pop("max_model_len", 64)
    backend = Gated(lanes=options.pop("lanes", 2), blocks=options.pop("blocks", 64), max_model_len=length)
    core = LaneCore(backend, fake_text, [EOS], max_queue=options.pop("max_queue", 8),
                    max_rows=options.pop("max_rows", 256), max_decisions=options.pop("max_decisions", 64),
                    cache_bytes=options.pop("cache_bytes", 0))
    labels, urls = options.pop("labels", False), options.pop("vision_urls", None)
    if urls is None:
        text = tokenizer(folder, labels, options.pop("template", CHATML))
        grammars = GrammarEngine.for_tokenizer(text, text.vocab_size, text.eos_ids | {EOS})  # checks requests' grammars
        return Service(core, text, "tiny", "fake", length, max_body=MAX_BODY, grammars=grammars, **options), backend
    ids = write_vl_tokenizer(folder, labels=labels)
    tokens = VisionTokens(image=ids["<|image_pad|>"], video=ids["<|video_pad|>"], start=ids["<|vision_start|>"],
                          end=ids["<|vision_end|>"], tokens_per_second=None)
    inputs = VisionInputs(MediaFetcher(allow_urls=urls), tokens, **options.pop("vision_options", {}))
    text = Tokenizer.from_folder(folder, ids["size"])
    return Service(core, text, "tiny", "fake", length, max_body=MAX_BODY, vision=True, vision_inputs=inputs,
                   **options), backend


class RawAnswer:
    """An answer read off a raw connection with h11's client side, shaped like the httpx answers here."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self._body = status, headers, body

    def json(self):
        return json.loads(self._body)


async def send_raw(http: httpx.AsyncClient, data: bytes) -> RawAnswer:
    """`data` as it is, on a connection of its own: requests no HTTP client would write."""
    import h11

    stream = await trio.open_tcp_stream(http.base_url.host, http.base_url.port)
    reader = h11.Connection(h11.CLIENT)
    reader.send(h11.Request(method="POST", target="/", headers=[("Host", "test"), ("Content-Length", "0")]))
    reader.send(h11.EndOfMessage())
    async with stream:
        await stream.send_all(data)
        status, headers, body = 0, {}, b""
        while True:
            event = reader.next_event()
            if event is h11.NEED_DATA:
                reader.receive_data(await stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status, headers = event.status_code, {k.decode().title(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return RawAnswer(status, headers, body)


async def send(http: httpx.AsyncClient, method: str, path: str, body, headers: dict):
    if method == "RAW":
        return await send_raw(http, body)
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
    elif kind == "decider":
        service, backend = fake_service(folder, decides=True, labels=True)
    elif kind in ("vision", "vision-urls"):
        service, backend = fake_service(folder, vision_urls=kind == "vision-urls", max_model_len=512)
        assert service.vision_inputs.tokens.image == PAD
    elif kind == "vision-small-budget":
        service, backend = fake_service(folder, vision_urls=False, max_model_len=4096, blocks=512,
                                        vision_options={"gate": DecodeGate(budget_bytes=64 << 20)})
    elif kind == "slow-body":
        service, backend = fake_service(folder, body_timeout=0.2)
    elif kind == "vision-decider":
        service, backend = fake_service(folder, vision_urls=False, decides=True, labels=True, max_model_len=512)
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
