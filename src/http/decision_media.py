"""Images in decisions: `input_image` parts of /v1/decisions' messages and System One's `assets`.

Both become the state as the template's parts (text and `{"type": "image"}`, in order) beside the parts
to fetch; those go through chat's fetch and decode path once a request, within the decision's deadline,
and are expanded into every question's prompt. The state comes before every question, so an image's rows
are the same rows of every prompt, inside their common prefix: the decision's trunk.

System One puts each asset right after the first occurrence of its key in the state text (the JSON text
when the state is not a string); assets whose keys end at the same place keep the order of `assets`. A key
that does not occur in the state text is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import trio

from ..core.decider import common_prefix
from ..core.media import PromptMedia
from . import errors
from .media_fetch import MediaPart
from .service import Service

if TYPE_CHECKING:
    from .decisions import Refuse

IMAGE = {"type": "image"}  # the template's part for one image
ROLES = ("user", "system", "developer")
ASSET_TYPES = ("image",)
ASSET_FORMATS = ("png", "jpeg")
MAX_ASSETS = 64  # as many as a decision has questions


@dataclass(frozen=True)
class DecisionInput:
    """What a decision asks about: the system text, the state (its text, or template parts when it holds
    images) and the images to fetch, in the order their placeholders take in the state."""

    system: str | None
    state: str | list[dict]
    images: tuple[MediaPart, ...] = ()


def joined(pieces: Sequence[str | dict]) -> str | list[dict]:
    """Text pieces and image parts as one text, or as template parts with adjacent texts merged."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)  # type: ignore[arg-type]
    parts: list[dict] = []
    for piece in pieces:
        if isinstance(piece, dict):
            parts.append(piece)
        elif piece and parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": parts[-1]["text"] + piece}
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def parse_input(refuse: "Refuse", raw: Any, vision: bool) -> DecisionInput:
    """/v1/decisions' input: a string, or messages; a user message's `input_image` parts (with --vision)
    stand where they are among its text, user messages joined by a blank line."""
    if isinstance(raw, str):
        return DecisionInput(None, raw)
    if not isinstance(raw, list) or not raw:
        raise refuse("input", "'input' must be a string or a non-empty list of messages")
    system: list[str] = []
    user: list[str | dict] = []
    images: list[MediaPart] = []
    for i, message in enumerate(raw):
        m = refuse.fields(message, f"input[{i}]", {"role", "content"}, {"role", "content"})
        if m["role"] not in ROLES:
            raise refuse(f"input[{i}].role", f"'input[{i}].role' must be user, system or developer")
        content = m["content"]
        if isinstance(content, str):
            pieces: list[str | dict] = [content]
        elif isinstance(content, list):
            pieces = [content_part(refuse, part, f"input[{i}].content[{j}]", m["role"], vision, images)
                      for j, part in enumerate(content)]
        else:
            raise refuse(f"input[{i}].content", f"'input[{i}].content' must be a string or a list of parts")
        if m["role"] != "user":
            system.append("".join(pieces))  # type: ignore[arg-type]  # only text: images go in user messages
            continue
        if user:
            user.append("\n\n")
        user.extend(pieces)
    return DecisionInput("\n\n".join(system) or None, joined(user), tuple(images))


def content_part(refuse: "Refuse", part: Any, at: str, role: str, vision: bool, images: list[MediaPart]) -> str | dict:
    """One part of a message's content: its text, or (an `input_image`) the image's template part, whose
    URL is appended to `images`."""
    if isinstance(part, dict) and part.get("type") == "input_image":
        if not vision:
            raise errors.vision_off(at)
        if role != "user":
            raise errors.image_outside_user(at)
        p = refuse.fields(part, at, {"type", "image_url", "detail"}, {"type", "image_url"})
        # `detail` is accepted and ignored: an image's size here is set by the server's pixel bounds alone.
        images.append(MediaPart(refuse.string(p["image_url"], f"{at}.image_url"), "image", f"{at}.image_url"))
        return IMAGE
    p = refuse.fields(part, at, {"type", "text"}, {"type", "text"})
    if p["type"] != "input_text":
        raise refuse(f"{at}.type", f"'{at}.type' must be input_text or input_image")
    return refuse.string(p["text"], f"{at}.text")


def place_assets(refuse: "Refuse", raw: Any, state_text: str) -> DecisionInput:
    """System One's state with its `assets` (already known to be on a --vision server): each image right
    after the first occurrence of its key in `state_text`, as a data URL of its format."""
    if not raw:
        return DecisionInput(None, state_text)
    assets = refuse.items(raw, "assets", 1, MAX_ASSETS, dict)
    placed: list[tuple[int, int, MediaPart]] = []  # (where its image goes, its place in `assets`, the part)
    for order, (key, asset) in enumerate(assets.items()):
        at = f"assets.{key}"
        a = refuse.fields(asset, at, {"type", "format", "data_base64"}, {"type", "format", "data_base64"})
        if a["type"] not in ASSET_TYPES:
            raise errors.asset_value(f"{at}.type", ASSET_TYPES)
        if a["format"] not in ASSET_FORMATS:
            raise errors.asset_value(f"{at}.format", ASSET_FORMATS)
        data = refuse.string(a["data_base64"], f"{at}.data_base64")
        where = state_text.find(key)
        if where < 0:
            raise errors.asset_not_in_state(key)
        url = f"data:image/{a['format']};base64,{data}"
        placed.append((where + len(key), order, MediaPart(url, "image", f"{at}.data_base64")))
    placed.sort(key=lambda p: p[:2])
    pieces: list[str | dict] = []
    cut = 0
    for end, _, _ in placed:
        pieces += [state_text[cut:end], IMAGE]
        cut = end
    pieces.append(state_text[cut:])
    return DecisionInput(None, joined(pieces), tuple(part for _, _, part in placed))


async def with_images(service: Service, prompts: Sequence[Sequence[int]], images: Sequence[MediaPart], deadline: float,
                      param: str, status: int, lengths_fit: Callable[[list[int]], None]
                      ) -> tuple[list[tuple[int, ...]], tuple[PromptMedia, ...]]:
    """Every question's prompt with its images' rows, and the one PromptMedia tuple they all share.

    The images are fetched, measured and (once `lengths_fit` has taken every prompt's measured length)
    decoded once, within `deadline`; refusals answer with `status`."""
    inputs = service.vision_inputs
    prepared = None
    with trio.move_on_at(deadline):
        try:
            measured = await inputs.measure(images)
            for prompt in prompts:
                inputs.check_placeholders(prompt, [m.kind for m in measured])
            lengths_fit([inputs.rows(prompt, measured) for prompt in prompts])
            prepared = await inputs.decode(images, measured)
        except errors.ApiError as error:
            raise dataclasses.replace(error, status=status, param=param if error.param is None else error.param) from None
    if prepared is None:
        raise errors.deadline_exceeded()
    try:
        expanded = [inputs.expand(prompt, prepared) for prompt in prompts]
    except errors.ApiError as error:
        raise dataclasses.replace(error, status=status, param=param) from None
    out = [prompt for prompt, _ in expanded]
    media = expanded[0][1]
    check_shared(out, [m for _, m in expanded])
    return out, media


def check_shared(prompts: Sequence[Sequence[int]], media: Sequence[Sequence[PromptMedia]]) -> None:
    """Raise AssertionError unless every prompt's images are the same rows, inside the prompts' common
    prefix (a bug if not: the state, which holds every image, comes before every question)."""
    rows = [[(m.start, m.rows, m.digest) for m in one] for one in media]
    common = common_prefix(prompts)
    if any(r != rows[0] for r in rows) or (media[0] and media[0][-1].end > common):
        starts = [[start for start, _, _ in r] for r in rows]
        raise AssertionError(f"a decision's images are not the same rows of every prompt: {starts}, common {common}")
