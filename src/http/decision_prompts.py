"""What a decision asks the model, and what its answer is made of (specs/DECISIONS.md, "How an answer is
computed"): the rendered prompt of each question, the label tokens found once per model, and the
probabilities read from the label logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..core.plan import LabelRead
from ..text.chat import ChatTemplateError
from ..text.tokenizer import Tokenizer

LABELS = {"predicate": ("yes", "no"), "choice": tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), "score": tuple("0123456789")}
ASK = {"predicate": "Answer with yes or no only.", "choice": "Answer with the letter of one option only.",
       "score": "Answer with the number of one level only."}


@dataclass(frozen=True)
class Option:
    name: str  # as the prompt shows it
    description: str | None = None
    value: Any = None  # as the answer echoes it (a choice's value may be a boolean); None: the name


@dataclass(frozen=True)
class Question:
    """A question in the model's terms: its kind (predicate, choice or score), instructions and options."""

    kind: str
    instructions: str
    options: tuple[Option, ...]

    @property
    def labels(self) -> tuple[str, ...]:
        return LABELS[self.kind][: len(self.options)]

    def block(self) -> str:
        lines = [f"Question: {self.instructions}"]
        for label, option in zip(self.labels, self.options):
            lines.append(f"{label}: {option.name} - {option.description}" if option.description else f"{label}: {option.name}")
        lines.append(ASK[self.kind])
        return "\n".join(lines)


def entry_text(entry: Any) -> str:
    """A System One entry as text: strings as they are, anything else as JSON."""
    return entry if isinstance(entry, str) else json.dumps(entry, ensure_ascii=False)


def render(tokenizer: Tokenizer, system: str | None, state: str | Sequence[dict], question: Question) -> list[int]:
    """The question's prompt: an optional system message, then the state and the question block as the user's.

    `state` is its text, or the template's parts (text and `{"type": "image"}`, in order) when it holds
    images: the question block then follows as one more text part, so that the template writes an image's
    placeholder where it stands and the text reads as it would without images."""
    if isinstance(state, str):
        content: str | list[dict] = f"{state}\n\n{question.block()}"
    else:
        content = [*state, {"type": "text", "text": f"\n\n{question.block()}"}]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=False)


class LabelsNotSingleTokens(Exception):
    """This model's tokenizer splits a label or merges it with what comes before it."""


def find_label_tokens(tokenizer: Tokenizer) -> dict[str, dict[str, int]]:
    """Each label set's tokens: after the generation prompt, every label must add exactly one distinct token."""
    if tokenizer.chat_template is None:
        raise LabelsNotSingleTokens("the model has no chat template")
    try:
        text = tokenizer.render_chat([{"role": "user", "content": "Question?"}], add_generation_prompt=True,
                                     enable_thinking=False)
    except ChatTemplateError as error:
        raise LabelsNotSingleTokens(str(error)) from None
    base = tokenizer.encode_prompt(text)
    found: dict[str, dict[str, int]] = {}
    for kind, labels in LABELS.items():
        tokens: dict[str, int] = {}
        for label in labels:
            ids = tokenizer.encode_prompt(text + label)
            if len(ids) != len(base) + 1 or ids[: len(base)] != base:
                raise LabelsNotSingleTokens(f"the label {label!r} is not one token after the generation prompt")
            tokens[label] = ids[-1]
        if len(set(tokens.values())) != len(tokens):
            raise LabelsNotSingleTokens(f"the {kind} labels share tokens")
        found[kind] = tokens
    return found


@dataclass(frozen=True)
class Probabilities:
    """softmax over the labels' logprobs, how much of the whole distribution the labels hold, and the
    confidence (the top label's probability times that mass)."""

    p: tuple[float, ...]
    label_mass: float
    confidence: float
    top: int
    argmax_is_label: bool


def probabilities(read: LabelRead) -> Probabilities:
    top_lp = max(read.logprobs)
    weights = [math.exp(lp - top_lp) for lp in read.logprobs]
    total = sum(weights)
    p = tuple(w / total for w in weights)
    mass = sum(math.exp(lp) for lp in read.logprobs)
    top = max(range(len(p)), key=p.__getitem__)
    return Probabilities(p, mass, p[top] * mass, top, read.argmax_is_label)


def score_value(p: Sequence[float]) -> float:
    return sum(i * pi for i, pi in enumerate(p))
