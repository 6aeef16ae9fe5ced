"""POST /v1/completions, and what chat shares with it: submit the n streams, media, usage, and the
server-sent events that end with `data: [DONE]`; answers in OpenAI's shapes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import AsyncIterator, Sequence

import trio

from ..core.sampling import InvalidParameter
from ..core.stream import EngineError, Finished, Failed, PromptLogprobs, TokenEvent
from . import errors, parse, structured
from .exchange import Exchange
from .generation import Choice, close_all, collect, events, open_streams
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


async def stream_body(streams, common, head: dict, deadline: float, exchange: Exchange, opening: list[dict],
                      token, finish) -> AsyncIterator[str]:
    """The server-sent events chat and completions share: the opening choices, a chunk for each token that
    `token` makes (none, one or a list) and at each choice's end, the usage when asked, `[DONE]`; an engine error on the
    way becomes its error event and the stream's status in the log."""
    try:
        for choice in opening:
            yield sse({**head, "choices": [choice]})
        async for index, event in events(streams, deadline, exchange.timing):
            if isinstance(event, TokenEvent):
                exchange.completion_tokens += 1
                for choice in chunks(token(index, event)):
                    yield sse({**head, "choices": [choice]})
            elif isinstance(event, Finished):
                exchange.cached_tokens = max(exchange.cached_tokens, event.cached_tokens)
                for choice in chunks(finish(index, event)):
                    yield sse({**head, "choices": [choice]})
            elif isinstance(event, Failed):
                raise errors.from_engine(event.error)
        if common.include_usage:
            yield sse({**head, "choices": [], "usage": usage(exchange.prompt_tokens, exchange.completion_tokens,
                                                             exchange.cached_tokens)})
        yield "data: [DONE]\n\n"
    except errors.ApiError as error:
        exchange.status = error.status  # the stream's status as the log line reports it
        yield sse(error.body())
        yield "data: [DONE]\n\n"
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

def prompt_ids(service: Service, prompts: list[str | list[int]]) -> list[list[int]]:
    vocab = service.vocab_size
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(service.tokenizer.encode(prompt))
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
    ids = prompt_ids(service, prompts)
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
        return completion_sse(service, streams, common, head, deadline, exchange, echoes, starts)
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


def completion_sse(service, streams, common, head, deadline, exchange, echoes, starts) -> AsyncIterator[str]:
    offsets = list(starts)  # where each choice's next token starts
    opening = [{"index": index, "text": text, "logprobs": None, "finish_reason": None}
               for index, text in enumerate(echoes) if text]

    def token(index: int, event: TokenEvent) -> dict | None:
        logprobs = None
        if common.sampling.logprobs:
            text = token_text(service, event.token)
            logprobs = {"tokens": [text], "token_logprobs": [event.logprob],
                        "top_logprobs": [{token_text(service, t.token): t.logprob for t in event.top}],
                        "text_offset": [offsets[index]]}
            offsets[index] += len(text)  # as completion_logprobs counts: each token's own text
        if not (event.text or logprobs):
            return None
        return {"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": None}

    def finish(index: int, event: Finished) -> dict:
        return {"index": index, "text": event.text, "logprobs": None, "finish_reason": finish_reason(event)}

    return stream_body(streams, common, {**head, "object": "text_completion"}, deadline, exchange, opening, token,
                       finish)
