"""POST /v1/completions, and what chat shares with it: submit the n streams, media, usage, and the
server-sent events that end with `data: [DONE]`; answers in OpenAI's shapes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from json.encoder import encode_basestring as encode_string  # json.dumps's own escape of a str, without its 0.9 us of set-up a token
from typing import AsyncIterator, Callable, Sequence

import trio

from ..core.sampling import InvalidParameter
from ..core.stream import EngineError, Finished, Failed, PromptLogprobs, TokenEvent
from . import errors, parse, structured
from .exchange import Exchange
from .generation import Choice, batches, close_all, collect, open_streams
from .offload import sized
from .service import Service


def check_model(service: Service, body: dict) -> str:
    name = body.get("model", service.model_name)
    if not isinstance(name, str):
        raise errors.wrong_type("model", "a string")
    if name not in (service.model_name, *parse.MODEL_ALIASES):
        raise errors.unknown_model(name, service.model_name)
    return service.model_name


async def submit(service: Service, prompt: Sequence[int], common: parse.Common, deadline: float, param: str, media=()):
    try:
        return await open_streams(service.core, prompt, common.sampling, common.n, deadline, media)
    except (EngineError, InvalidParameter) as error:
        raise errors.from_engine(error, param) from None


def token_text(service: Service, token: int) -> str:
    return service.tokenizer.decode([token], skip_special_tokens=False)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


async def with_media(service: Service, prompt: Sequence[int], parts, deadline: float, param: str, *,
                     room_for: int | None = None):
    """The prompt with its images' and videos' rows, and their media; fetching counts toward the deadline.

    Parts are measured from their headers before any is decoded: placeholders must match them, and with
    `room_for` (a generation's max_tokens, 0 when it has none) a prompt whose rows leave no room for it is
    refused as the lane core would refuse it. Without it (/v1/tokenize) the rows are only counted."""
    if not parts:
        return prompt, ()
    inputs = service.vision_inputs
    with trio.move_on_at(deadline):
        try:
            measured = await inputs.measure(parts)
            inputs.check_placeholders(prompt, [m.kind for m in measured])
            if room_for is not None:
                check_room(inputs.rows(prompt, measured), room_for, service.context_room(), param)
            return inputs.expand(prompt, await inputs.decode(parts, measured))
        except errors.ApiError as error:
            # refusals of the whole request (too many parts, placeholders) name the prompt's parameter; a part's, its own
            raise (dataclasses.replace(error, param=param) if error.param is None else error) from None
    raise errors.deadline_exceeded()


def check_room(rows: int, room_for: int, room: int, param: str) -> None:
    """The lane core's own check on a stream's length, made on measured rows: the same refusal, sooner."""
    if rows >= room:
        raise errors.context_exceeded(rows + 1, room, param)
    if rows + room_for > room:
        raise errors.context_exceeded(rows + room_for, room, param)


DONE = b"data: [DONE]\n\n"
MARK = "\x00"  # a text that stands for a delta's text in a choice's template (json writes it "\u0000")


class SseStream:
    """A streamed answer: its SSE bytes, a batch of events at a time, and what ends it if the request's
    deadline passes on the way (the server keeps that deadline: one cancel scope a request). `aclose` (the
    server's, always) closes the streams and calls `on_end` even when the body never began."""

    def __init__(self, streams, chunks: AsyncIterator[bytes], deadline_answer: tuple[int, bytes]) -> None:
        self.deadline_answer = deadline_answer
        self.on_end: Callable[[], None] | None = None  # set by the application: the request's open slot given back
        self._streams, self._chunks = streams, chunks

    def __aiter__(self) -> "SseStream":
        return self

    def __anext__(self):
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await self._chunks.aclose()
        finally:
            await close_all(self._streams)  # idempotent; the body's own finally has run if it began
            if self.on_end is not None:
                self.on_end()


class SseChunks:
    """A request's `data:` chunks: the fixed head encoded once, a plain text delta from its choice's
    template (its text the only part encoded a token), the same bytes as `sse({**head, "choices": [c]})`."""

    def __init__(self, head: dict, plain: Callable[[int, str], dict] | None, choices: int) -> None:
        self._head = head
        opening = json.dumps({**head, "choices": []}, ensure_ascii=False)
        self._open, self._close = f"data: {opening[:-2]}".encode(), b"]}\n\n"  # up to `"choices": [`
        self._plain = [self._template(plain(i, MARK)) for i in range(choices)] if plain is not None else []

    def _template(self, choice: dict) -> tuple[bytes, bytes]:
        before, after = json.dumps(choice, ensure_ascii=False).split(json.dumps(MARK))
        return self._open + before.encode(), after.encode() + self._close

    def choice(self, choice: dict) -> bytes:
        return b"".join((self._open, json.dumps(choice, ensure_ascii=False).encode(), self._close))

    def usage(self, usage: dict) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage}).encode()

    def text(self, index: int, text: str) -> bytes:
        before, after = self._plain[index]
        return b"".join((before, encode_string(text).encode(), after))


def stream_body(streams, common, head: dict, exchange: Exchange, opening: list[dict], token, finish,
                plain: Callable[[int, str], dict] | None = None) -> SseStream:
    """The server-sent events chat and completions share: the opening choices, a chunk for each token that
    `token` makes (none, a choice or a list of them, or a plain text delta as a string, made by `plain`'s
    template) and at each choice's end, the usage when asked, `[DONE]`; an engine error on the way becomes
    its error event and the stream's status in the log. The events that wait together go out in one write,
    each still its own chunk of OpenAI's shape."""
    sse_chunks = SseChunks(head, plain, len(streams))
    late = errors.deadline_exceeded()
    return SseStream(streams, _body(streams, common, exchange, opening, token, finish, sse_chunks),
                     (late.status, sse(late.body()).encode() + DONE))


async def _body(streams, common, exchange: Exchange, opening: list[dict], token, finish,
                sse_chunks: SseChunks) -> AsyncIterator[bytes]:
    out: list[bytes] = []
    try:
        if opening:
            yield b"".join(sse_chunks.choice(choice) for choice in opening)
        async for batch in batches(streams, exchange.timing):
            for index, event in batch:
                if type(event) is TokenEvent:
                    exchange.completion_tokens += 1
                    made = token(index, event)
                    if type(made) is str:
                        out.append(sse_chunks.text(index, made))
                    else:
                        out.extend(sse_chunks.choice(choice) for choice in chunks(made))
                elif isinstance(event, Finished):
                    exchange.cached_tokens = max(exchange.cached_tokens, event.cached_tokens)
                    out.extend(sse_chunks.choice(choice) for choice in chunks(finish(index, event)))
                elif isinstance(event, Failed):
                    raise errors.from_engine(event.error)
            if out:
                yield b"".join(out)
                out.clear()
        if common.include_usage:
            out.append(sse_chunks.usage(usage(exchange.prompt_tokens, exchange.completion_tokens, exchange.cached_tokens)))
        out.append(DONE)
        yield b"".join(out)
    except errors.ApiError as error:
        exchange.status = error.status  # the stream's status as the log line reports it
        yield b"".join((*out, sse(error.body()).encode(), DONE))
    finally:
        await close_all(streams)


def chunks(choices: dict | list[dict] | None) -> list[dict]:
    """What `token` or `finish` made: no chunk, one, or several (a tool call's deltas)."""
    if choices is None:
        return []
    return [choices] if isinstance(choices, dict) else choices


def finish_reason(event: Finished) -> str:
    return "length" if event.reason == "length" else "stop"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- completions ----

async def prompt_ids(service: Service, prompts: list[str | list[int]]) -> list[list[int]]:
    vocab = service.vocab_size
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(await sized(len(prompt), service.tokenizer.encode, prompt))
        elif any(not 0 <= t < vocab for t in prompt):
            raise errors.out_of_range("prompt", f"prompt token ids must be between 0 and {vocab - 1}")
        else:
            out.append(prompt)
    return out


def with_placeholders(service: Service, prompt: list[int], images: int) -> list[int]:
    """A completions prompt given `images` that holds no placeholder gets one image block a part in front."""
    tokens = service.vision_inputs.tokens
    if tokens.image in prompt or tokens.video in prompt:
        return prompt
    return [tokens.start, tokens.image, tokens.end] * images + list(prompt)


def completion_logprobs(service: Service, choice: Choice, prompt: list[int], echo: bool, offset: int) -> dict:
    tokens, values, tops = [], [], []
    if echo:
        lp = choice.prompt_logprobs or PromptLogprobs(tuple([None] * len(prompt)), tuple(() for _ in prompt))
        for token, value, top in zip(prompt, lp.logprobs, lp.top):
            tokens.append(token)
            values.append(value)
            tops.append({token_text(service, t.token): t.logprob for t in top} if value is not None else None)
    for event in choice.logprobs:
        tokens.append(event.token)
        values.append(event.logprob)
        tops.append({token_text(service, t.token): t.logprob for t in event.top})
    texts = [token_text(service, t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def completions(service: Service, body: dict, exchange: Exchange):
    prompts, common, echo = parse.completion(body)
    parts = parse.completion_images(body, service.vision)
    model = check_model(service, body)
    ids = await prompt_ids(service, prompts)
    deadline = exchange.deadline = trio.current_time() + service.request_timeout
    media = ()
    if parts:
        ids[0], media = await with_media(service, with_placeholders(service, ids[0], len(parts)), parts, deadline, "prompt",
                                         room_for=common.sampling.max_tokens or 0)
    exchange.prompt_tokens = sum(len(p) for p in ids)
    common = await structured.constrained(service, common, structured.wanted_of(body), deadline)
    opened = []
    try:
        for prompt in ids:
            opened.append(await submit(service, prompt, common, deadline, "prompt", media))
    except BaseException:
        await close_all([s for group in opened for s in group])
        raise
    streams = [s for group in opened for s in group]
    head = {"id": f"cmpl-{exchange.id}", "created": int(time.time()), "model": model}
    echoes = [service.tokenizer.decode(p, skip_special_tokens=False) if echo else "" for p in ids for _ in range(common.n)]
    if common.stream:
        # Where each choice's first generated token starts, counted as completion_logprobs counts offsets.
        starts = [sum(len(token_text(service, t)) for t in p) if echo and common.sampling.logprobs else 0
                  for p in ids for _ in range(common.n)]
        return completion_sse(service, streams, common, head, exchange, echoes, starts)
    choices = await collect(streams, deadline, exchange.timing)
    exchange.completion_tokens = sum(len(c.tokens) for c in choices)
    out = []
    for c in choices:
        prompt = ids[c.index // common.n]
        text = echoes[c.index] + "".join(c.text)
        logprobs = completion_logprobs(service, c, prompt, echo, 0) if common.sampling.logprobs else None
        out.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    cached = sum(c.cached_tokens for c in choices[:: common.n])  # once a prompt, as prompt_tokens counts
    return {**head, "object": "text_completion", "choices": out,
            "usage": usage(exchange.prompt_tokens, exchange.completion_tokens, cached)}


def completion_sse(service, streams, common, head, exchange, echoes, starts) -> SseStream:
    offsets = list(starts)  # where each choice's next token starts
    opening = [{"index": index, "text": text, "logprobs": None, "finish_reason": None}
               for index, text in enumerate(echoes) if text]

    def plain(index: int, text: str) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

    def token(index: int, event: TokenEvent) -> dict | str | None:
        if not common.sampling.logprobs:
            return event.text or None  # a plain delta, from its template
        text = token_text(service, event.token)
        logprobs = {"tokens": [text], "token_logprobs": [event.logprob],
                    "top_logprobs": [{token_text(service, t.token): t.logprob for t in event.top}],
                    "text_offset": [offsets[index]]}
        offsets[index] += len(text)  # as completion_logprobs counts: each token's own text
        return {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None}

    def finish(index: int, event: Finished) -> dict:
        return {"index": index, "text": event.text, "logprobs": None, "finish_reason": finish_reason(event)}

    return stream_body(streams, common, {**head, "object": "text_completion"}, exchange, opening, token, finish, plain)
