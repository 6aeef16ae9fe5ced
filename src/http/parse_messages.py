"""A chat request's messages and tools checked field by field (refusals from `errors`), before any reaches
the chat template."""

from __future__ import annotations

from typing import Any

from . import errors
from .media_fetch import MediaPart

ROLES = ("system", "user", "assistant", "tool", "developer")  # OpenAI's roles; the template sees them as given
MEDIA_PARTS = {"image_url", "input_image", "image", "video_url", "video", "input_audio"}
VISION_PARTS = {"image_url": "image", "video_url": "video"}  # the media parts chat takes, and their template type


def text_of(content: Any, index: int, vision: bool, media: list[MediaPart] | None = None) -> str | list[dict]:
    """A message's content as text: a string, or a list of text parts (media parts refused without --vision).

    With --vision, `image_url` and `video_url` parts are appended to `media` (in order) and the content
    comes back as the template's parts (`{"type": "image"}`, `{"type": "text", ...}`) when it has any."""
    where = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise errors.wrong_type(where, "a string or a list of content parts")
    texts, parts = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        elif kind in MEDIA_PARTS:
            if not vision or media is None:
                raise errors.vision_off()
            if kind not in VISION_PARTS:
                raise errors.unsupported(f"{where}[{j}].type")
            media.append(media_part(part, kind, f"{where}[{j}]"))
            parts.append({"type": VISION_PARTS[kind]})
        else:
            raise errors.wrong_type(where, "a string or a list of content parts")
    return parts if len(parts) > len(texts) else "".join(texts)


def media_part(part: dict, kind: str, where: str) -> MediaPart:
    """An OpenAI `image_url` / `video_url` part's URL (an object with `url`, or the URL itself)."""
    value = part.get(kind)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise errors.wrong_type(f"{where}.{kind}.url", "a URL string")
    return MediaPart(url, VISION_PARTS[kind], f"{where}.{kind}.url")


def messages(body: dict, vision: bool, media: list[MediaPart] | None = None) -> list[dict]:
    """The messages, checked: a known role each, content wherever OpenAI requires it (an assistant's may
    be left out beside its tool calls); media parts go to `media` (see `text_of`)."""
    raw = body.get("messages")
    if raw is None:
        raise errors.missing("messages")
    if not isinstance(raw, list) or not raw:
        raise errors.wrong_type("messages", "a non-empty list of messages")
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise errors.wrong_type(f"messages[{i}]", "an object with a 'role'")
        if message["role"] not in ROLES:
            raise errors.unknown_role(f"messages[{i}].role", ROLES)
        if message.get("content") is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise errors.missing(f"messages[{i}].content")
        out.append({**message, "content": text_of(message.get("content"), i, vision, media)})
    return out


def tools(body: dict) -> list[dict] | None:
    """The request's tools, each a function with a name (and, if given, a string description and an
    object of parameters), as OpenAI's and vLLM's schemas take them; None when there are none."""
    raw = body.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise errors.wrong_type("tools", "a list of tools")
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise errors.wrong_type(where, "an object with a 'function'")
        if tool.get("type", "function") != "function":
            raise errors.unsupported(f"{where}.type")
        function = tool.get("function")
        if function is None:
            raise errors.missing(f"{where}.function")
        if not isinstance(function, dict):
            raise errors.wrong_type(f"{where}.function", "an object")
        if function.get("name") is None:
            raise errors.missing(f"{where}.function.name")
        if not isinstance(function["name"], str) or not function["name"]:
            raise errors.wrong_type(f"{where}.function.name", "a non-empty string")
        for key, kind, expected in (("description", str, "a string"), ("parameters", dict, "an object")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise errors.wrong_type(f"{where}.function.{key}", expected)
    return raw
