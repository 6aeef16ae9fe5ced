"""Request bodies to engine requests: every field checked for type and range, refusals from `errors`.

The OpenAI API refuses arguments it does not know, and so does this server; arguments it knows but this
server does not honour are refused by name rather than ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from ..core.sampling import InvalidParameter, SamplingParams
from . import errors
from .media_fetch import MediaPart
from .parse_messages import messages, tools  # noqa: F401  (`messages` is also read by the tokenize route)

SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "stop", "n", "stream", "stream_options", "ignore_eos", "user", "metadata",
                   "store", "model", "logit_bias", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
                   "skip_special_tokens", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar", "response_format"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls", "response_format", "chat_template_kwargs",
                                 "add_generation_prompt", "continue_final_message"}
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "best_of", "images"}
UNSUPPORTED = {"suffix", "functions", "function_call", "audio", "modalities", "prediction",
               "web_search_options", "reasoning_effort", "service_tier"}
# Variables the request sets itself, which chat_template_kwargs may not pass to the template.
TEMPLATE_RESERVED = ("messages", "tools", "documents")
MODEL_ALIASES = ("default", "")  # names that mean the served model (vLLM takes an empty one too)
MAX_N = 16
TOKEN_ID = re.compile("0|[1-9][0-9]*")  # a logit_bias key: a token id in decimal, one spelling an id


@dataclass(frozen=True)
class Common:
    """What chat and completions requests share once parsed."""

    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool


def check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key in UNSUPPORTED:
            raise errors.unsupported(key)
        if key not in allowed:
            raise errors.unknown_parameter(key)


def _get(body: dict, name: str, kinds: tuple[type, ...], expected: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise errors.wrong_type(name, expected)
    if not isinstance(value, kinds):
        raise errors.wrong_type(name, expected)
    if isinstance(value, float) and not math.isfinite(value):
        raise errors.wrong_type(name, expected)
    return value


def number(body: dict, name: str, default: float) -> float:
    return float(_get(body, name, (int, float), "a number", default))


def integer(body: dict, name: str, default: int | None) -> int | None:
    return _get(body, name, (int,), "an integer", default)


def boolean(body: dict, name: str, default: bool) -> bool:
    return _get(body, name, (bool,), "a boolean", default)


def stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise errors.wrong_type("stop", "a string or a list of strings")
    return tuple(value)


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token id strings to biases) as sorted (id, bias) pairs; null and {} are none."""
    value = _get(body, "logit_bias", (dict,), "an object mapping token ids to biases", {})
    pairs = []
    for key, bias in value.items():
        if not TOKEN_ID.fullmatch(key):
            raise errors.logit_bias_key()
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise errors.wrong_type("logit_bias", "an object mapping token ids to biases")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def token_ids(body: dict, name: str) -> tuple[int, ...]:
    value = _get(body, name, (list,), "a list of token ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.wrong_type(name, "a list of token ids")
    return tuple(value)


def common(body: dict, *, max_tokens: int | None, logprobs: bool, top_logprobs: int, prompt_logprobs: bool = False,
           zero_tokens: bool = False) -> Common:
    """What chat and completions share; `zero_tokens`: max_tokens may be 0 (completions' echo)."""
    n = integer(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise errors.out_of_range("n", f"n must be between 1 and {MAX_N}")
    options = _get(body, "stream_options", (dict,), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise errors.wrong_type("stream_options.include_usage", "a boolean")
    if max_tokens is not None and max_tokens < (0 if zero_tokens else 1):
        raise errors.out_of_range("max_tokens", "max_tokens must be at least 1")
    _get(body, "user", (str,), "a string")
    seed = integer(body, "seed", None)
    sampling = SamplingParams(
        temperature=number(body, "temperature", 1.0),
        top_p=number(body, "top_p", 1.0),
        top_k=integer(body, "top_k", 0),
        min_p=number(body, "min_p", 0.0),
        seed=None if seed is None else seed & ((1 << 63) - 1),
        repetition_penalty=number(body, "repetition_penalty", 1.0),
        presence_penalty=number(body, "presence_penalty", 0.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0),
        max_tokens=max_tokens,
        stop=stops(body),
        ignore_eos=boolean(body, "ignore_eos", False),
        logit_bias=logit_bias(body),
        min_tokens=integer(body, "min_tokens", 0),
        stop_token_ids=token_ids(body, "stop_token_ids"),
        include_stop_str_in_output=boolean(body, "include_stop_str_in_output", False),
        skip_special_tokens=boolean(body, "skip_special_tokens", True),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        sampling.validate()
    except InvalidParameter as error:
        raise errors.out_of_range(error.param, error.message) from None
    return Common(sampling, n, boolean(body, "stream", False), include_usage)


def template_options(body: dict) -> dict:
    """What a chat request asks of the template beside its messages and tools: the generation prompt, an
    open final message, and `chat_template_kwargs` (the template's own variables, whose flags win over
    the request's, as in vLLM)."""
    extra = dict(_get(body, "chat_template_kwargs", (dict,), "an object", {}))
    for name in TEMPLATE_RESERVED:
        if name in extra:
            raise errors.reserved_template_variable(f"chat_template_kwargs.{name}", name)
    flags = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        flags[name] = boolean(body, name, default)
        given = extra.pop(name, None)
        if given is not None:
            if not isinstance(given, bool):
                raise errors.wrong_type(f"chat_template_kwargs.{name}", "a boolean")
            flags[name] = given
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise errors.generation_prompt_and_continue()
    return {**extra, **flags}


def chat(body: dict, vision: bool, media: list[MediaPart] | None = None) -> tuple[list[dict], Common, dict]:
    """The messages, what chat shares with completions, and the template's options (`template_options`)."""
    check_fields(body, CHAT_FIELDS)
    msgs = messages(body, vision, media)
    tools(body)
    template = template_options(body)
    max_tokens = integer(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", None)
    wants = boolean(body, "logprobs", False)
    top = integer(body, "top_logprobs", 0)
    if top and not wants:
        raise errors.out_of_range("top_logprobs", "top_logprobs needs logprobs set to true")
    return msgs, common(body, max_tokens=max_tokens, logprobs=wants, top_logprobs=top), template


def completion_prompts(body: dict) -> list[str | list[int]]:
    """The prompts of a completions request: a string, a list of strings, token ids, or lists of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise errors.missing("prompt")
    expected = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise errors.wrong_type("prompt", expected)


def completion_images(body: dict, vision: bool) -> list[MediaPart]:
    """A completions request's `images`: URLs (or `{"url": ...}` objects), for a single prompt; with --vision only."""
    images = body.get("images")
    if images is None:
        return []
    if not vision:
        raise dataclasses.replace(errors.vision_off(), param="images")
    if not isinstance(images, list) or not images:
        raise errors.wrong_type("images", "a non-empty list of image URLs")
    if len(completion_prompts(body)) != 1:
        raise errors.out_of_range("images", "images go with a single prompt")
    parts = []
    for i, image in enumerate(images):
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise errors.wrong_type(f"images[{i}]", "a URL string")
        parts.append(MediaPart(url, "image", f"images[{i}]"))
    return parts


def completion(body: dict) -> tuple[list[str | list[int]], Common, bool]:
    check_fields(body, COMPLETION_FIELDS)
    prompts = completion_prompts(body)
    top = integer(body, "logprobs", None)
    if top is not None and not 0 <= top <= 5:
        raise errors.out_of_range("logprobs", "logprobs must be between 0 and 5")
    echo = boolean(body, "echo", False)
    best_of = integer(body, "best_of", None)
    if best_of is not None and best_of != integer(body, "n", 1):
        raise errors.unsupported("best_of")
    max_tokens = integer(body, "max_tokens", 16)
    if max_tokens == 0 and not echo:
        raise errors.max_tokens_zero()
    # max_tokens 0 with echo: the prompt (with its logprobs, if asked) and no token drawn, as lm-eval reads it
    parsed = common(body, max_tokens=max_tokens, logprobs=top is not None, top_logprobs=top or 0,
                    prompt_logprobs=echo and top is not None, zero_tokens=echo)
    return prompts, parsed, echo


# ---- the whole body, once, before any field is read ----

MAX_DEPTH = 128  # far past any real request, far inside the stack that json, templates and replies recurse on
SURROGATE = re.compile("[\\ud800-\\udfff]")  # a lone one, which JSON's escapes allow: no tokenizer or UTF-8 reply takes it
SCALARS = frozenset({int, float, bool, type(None)})


def check_body(body: dict, status: int = 400) -> None:
    """Refuse nesting deeper than MAX_DEPTH and text that is not valid Unicode (keys too), naming where.

    One pass over the parsed body, with its own stack (never the interpreter's), so every field read after
    it, tokenized or echoed in a refusal, is text that encodes."""
    stack: list[tuple[Any, tuple]] = [(body, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise errors.nested_too_deeply(MAX_DEPTH)
        if isinstance(value, list) and SCALARS.issuperset(map(type, value)):
            continue  # token ids and the like: nothing to look at, item by item
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if (isinstance(key, str) and SURROGATE.search(key)) or (isinstance(item, str) and SURROGATE.search(item)):
                raise errors.not_unicode(field_name(path + (key,)), status)
            if isinstance(item, (dict, list)):
                stack.append((item, path + (key,)))


def field_name(path: tuple) -> str:
    """`messages[0].content`: keys joined by dots, indices in brackets, what is not Unicode escaped."""
    name = ""
    for key in path:
        if isinstance(key, int):
            name += f"[{key}]"
        else:
            key = key.encode("utf-8", "backslashreplace").decode("utf-8")
            name += f".{key}" if name else key
    return name
