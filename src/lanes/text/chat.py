"""Hugging Face chat templates rendered in Jinja's immutable sandbox, with transformers' conventions."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning arrives under; transformers copies it to all of them before rendering.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' mark of where the final message ends


class ChatTemplateError(Exception):
    """A chat that cannot be rendered: no template, a template that does not compile, or one that fails.

    `str()` is one line fit to show a client: the template's own `raise_exception` text, or the fault.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def raise_exception(message: str) -> None:
    """The global templates call to refuse a conversation (`raise_exception('roles must alternate')`)."""
    raise ChatTemplateError(str(message))


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' `tojson`: no HTML escaping (Jinja's own escapes `<`, which tool schemas use)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class TemplateDict:
    """`dict` for templates: a constructor and `fromkeys`, and no class object to climb out through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names so no template can store or reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")


class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def one_line(error: BaseException) -> str:
    message = error.message if isinstance(error, jinja2.TemplateError) and error.message else str(error)
    return " ".join(message.split())


def plain(value: Any) -> Any:
    """`value` rebuilt from JSON types only, so the sandbox never sees an object with methods of its own.

    Anything else (an image, an array) becomes a placeholder naming its type, as transformers does.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is None dropped
    (OpenAI clients send `content: null` beside tool calls), reasoning copied under every name."""
    normalized = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"a chat message must be an object, not {type(message).__name__}")
        message = {key: plain(value) for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


class ChatTemplate:
    """A compiled chat template. `render` gives the text transformers' `apply_chat_template(tokenize=False)`
    gives for the same template, messages and variables, or raises ChatTemplateError; never anything else.

    Constructing one raises ChatTemplateError when the source does not compile.
    """

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        environment = _environment()
        try:
            self._template = environment.from_string(source)
            tree = environment.parse(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(f"chat template does not compile: {one_line(error)} (line {error.lineno})") from None
        literals = {node.data for node in tree.find_all(jinja2.nodes.TemplateData)}
        literals |= {node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
        # Joined with NULs so that a search cannot match across two literals (transformers' literal text).
        self.literal_text = "\0".join(sorted(literals))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text. `extra` reaches the template as variables (`enable_thinking=False`, ...).

        `continue_final_message` leaves the last message open (no end of turn after its content), so the
        model continues it, as transformers does; it cannot go with `add_generation_prompt`."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        chat = normalize_messages(messages)
        final = _tag_final_message(chat, self.source) if continue_final_message else None
        text = self._render(chat, add_generation_prompt, tools, documents, extra)
        return text if final is None else _cut_at_tag(text, final)

    def _render(self, chat: list[dict[str, Any]], add_generation_prompt: bool, tools, documents, extra) -> str:
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **plain(extra)}
        try:
            return self._template.render(
                messages=chat,
                tools=plain(list(tools)) if tools is not None else None,
                documents=plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {one_line(error)}") from None
        # Templates do arithmetic and indexing on client data; those faults are the request's, not ours.
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError) as error:
            raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {one_line(error)}") from None


def _tag_final_message(chat: list[dict[str, Any]], source: str) -> str:
    """Append transformers' tag to the last message's content (its last text part), where it ends; returns
    that text as it was."""
    if not chat:
        raise ChatTemplateError("continue_final_message is set but the conversation is empty")
    content = chat[-1].get("content")
    if content is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue')
    if "content" not in source:
        raise ChatTemplateError('continue_final_message is set but the chat template does not read "content"')
    if isinstance(content, (list, tuple)):
        part = next((p for p in reversed(content) if isinstance(p, dict) and "text" in p), None)
        if part is None:
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        final, part["text"] = part["text"], f"{part['text']}{CONTINUE_TAG}"
        return final
    chat[-1]["content"] = f"{content}{CONTINUE_TAG}"
    return content


def _cut_at_tag(text: str, final: str) -> str:
    """The rendering up to the tag: the final message left open (trailing space trimmed where the template trims)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template drops the final message's end")
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
