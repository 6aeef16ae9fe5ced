"""POST /v1/decisions and /v1/systemone (specs/DECISIONS.md): parse, render each question, run the
decision on the lane core (trunk once, branches beside live streams), answer with probabilities.

/v1/decisions refuses bad bodies with 400 in OpenAI's shape; /v1/systemone with 422 naming the field.
Images (`input_image` parts, System One's `assets`) need --vision; src/http/decision_media.py places them.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

import trio

from ..core.decider import DecisionRequest, DecisionTimeout
from ..core.stream import EngineError
from . import errors
from .parse import MODEL_ALIASES
from .decision_media import DecisionInput, parse_input, place_assets, with_images
from .decision_prompts import LabelsNotSingleTokens, Option, Question, entry_text, find_label_tokens, probabilities, render, score_value
from .service import Service

KINDS = {"predicate", "choice", "score"}
DECISIONS_STATUS, SYSTEMONE_STATUS = 400, 422  # what each endpoint answers a bad field with


def not_available(reason: str) -> errors.ApiError:
    return errors.ApiError(501, f"decisions are not available for this model: {reason}", type="server_error",
                           code="labels_not_single_tokens")


def labels_of(service: Service) -> dict[str, dict[str, int]]:
    if service.label_tokens is None:
        try:
            service.label_tokens = find_label_tokens(service.tokenizer)
        except LabelsNotSingleTokens as error:
            service.label_tokens = str(error)
    if isinstance(service.label_tokens, str):
        raise not_available(service.label_tokens)
    return service.label_tokens


class Refuse:
    """Field checks that raise the endpoint's own refusal (400 for decisions, 422 for System One)."""

    def __init__(self, status: int) -> None:
        self.status = status

    def __call__(self, field: str, message: str) -> errors.ApiError:
        return errors.ApiError(self.status, message, param=field, code="invalid_request")

    def fields(self, body: Any, where: str, allowed: set[str], required: set[str]) -> dict:
        if not isinstance(body, dict):
            raise self(where, f"'{where}' must be an object")
        for key in body:
            if key not in allowed:
                raise self(f"{where}.{key}" if where else key, f"unrecognized field: {f'{where}.' if where else ''}{key}")
        for key in required:
            if key not in body:
                raise self(f"{where}.{key}" if where else key, f"'{f'{where}.' if where else ''}{key}' is required")
        return body

    def string(self, value: Any, field: str, limit: int | None = None, optional: bool = False) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or (limit is not None and len(value) > limit):
            raise self(field, f"'{field}' must be a string" + (f" of at most {limit} characters" if limit else ""))
        return value

    def items(self, value: Any, field: str, low: int, high: int, kind: type = list) -> Any:
        if not isinstance(value, kind) or not low <= len(value) <= high:
            noun = "a list" if kind is list else "an object"
            raise self(field, f"'{field}' must be {noun} of {low} to {high} items")
        return value


def served_model(service: Service, name: str) -> str:
    """The served model's name for `name` (itself or an alias, as chat and completions take them)."""
    if name not in (service.model_name, *MODEL_ALIASES):
        raise errors.unknown_model(name, service.model_name)
    return service.model_name


def check_length(service: Service, lengths: list[int], param: str, status: int) -> None:
    """A question longer than a lane can hold would wait out its deadline: refuse it now, as chat does."""
    room = service.context_room()  # the lane core's own bound on a stream
    longest = max(lengths)
    if longest > room:
        raise errors.decision_too_long(longest, room, param, status)


async def prompts_of(service: Service, given: DecisionInput, questions: list[Question], deadline: float, param: str,
                     status: int) -> tuple[list[tuple[int, ...]], tuple]:
    """Each question's prompt over the input, its images' rows expanded, and the images' media."""
    prompts = [render(service.tokenizer, given.system, given.state, q) for q in questions]
    check_length(service, [len(p) for p in prompts], param, status)
    if not given.images:
        return [tuple(p) for p in prompts], ()
    # again, before any image is decoded: each takes as many rows as its measured grid has merged patches
    fits = partial(check_length, service, param=param, status=status)
    return await with_images(service, prompts, given.images, deadline, param, status, fits)


async def run(service: Service, prompts: list[tuple[int, ...]], labels: list[tuple[int, ...]], deadline: float,
              media: tuple = ()):
    try:
        return await service.core.decide(DecisionRequest(tuple(prompts), tuple(labels), deadline, media))
    except DecisionTimeout:
        raise errors.deadline_exceeded() from None
    except EngineError as error:
        raise errors.from_engine(error) from None


# ---- /v1/decisions ----

def parse_question(refuse: Refuse, raw: Any, at: str) -> tuple[Question, str | None]:
    body = refuse.fields(raw, at, {"type", "instructions", "name", "choices", "levels"}, {"type", "instructions"})
    kind = body["type"]
    if kind not in KINDS:
        raise refuse(f"{at}.type", f"'{at}.type' must be one of predicate, choice, score")
    if "name" in body and body["name"] is None:
        raise refuse(f"{at}.name", f"'{at}.name' must be a string when given")
    name = refuse.string(body.get("name"), f"{at}.name", optional=True)
    instructions = refuse.string(body["instructions"], f"{at}.instructions")
    if kind == "predicate":
        for extra in ("choices", "levels"):
            if extra in body:
                raise refuse(f"{at}.{extra}", f"unrecognized field: {at}.{extra}")
        return Question("predicate", instructions, (Option("true"), Option("false"))), name
    if kind == "choice":
        choices = refuse.items(body.get("choices"), f"{at}.choices", 2, 26)
        options, seen = [], set()
        for i, choice in enumerate(choices):
            c = refuse.fields(choice, f"{at}.choices[{i}]", {"value", "description"}, {"value"})
            value = c["value"]
            if not isinstance(value, (str, bool)):
                raise refuse(f"{at}.choices[{i}].value", f"'{at}.choices[{i}].value' must be a string or a boolean")
            if (type(value), value) in seen:
                raise refuse(f"{at}.choices[{i}].value", f"'{at}.choices' values must be distinct")
            seen.add((type(value), value))
            options.append(Option(str(value).lower() if isinstance(value, bool) else value,
                                  refuse.string(c.get("description"), f"{at}.choices[{i}].description", optional=True),
                                  value))
        return Question("choice", instructions, tuple(options)), name
    levels = refuse.items(body.get("levels"), f"{at}.levels", 2, 10)
    options = []
    for i, level in enumerate(levels):
        lv = refuse.fields(level, f"{at}.levels[{i}]", {"label", "description"}, {"label"})
        label = refuse.string(lv["label"], f"{at}.levels[{i}].label")
        if any(o.name == label for o in options):  # as choices' values, so every answer names one level
            raise refuse(f"{at}.levels[{i}].label", f"'{at}.levels' labels must be distinct")
        description = refuse.string(lv.get("description"), f"{at}.levels[{i}].description", optional=True)
        options.append(Option(label, description))
    return Question("score", instructions, tuple(options)), name


async def decisions(service: Service, body: dict) -> dict:
    refuse = Refuse(DECISIONS_STATUS)
    refuse.fields(body, "", {"model", "input", "questions", "safety_identifier", "prompt_cache_key"},
                  {"model", "input", "questions"})
    model = served_model(service, refuse.string(body["model"], "model"))
    refuse.string(body.get("safety_identifier"), "safety_identifier", 128, optional=True)
    refuse.string(body.get("prompt_cache_key"), "prompt_cache_key", 64, optional=True)
    deadline = trio.current_time() + service.decision_timeout  # fetching its images counts toward it
    given = parse_input(refuse, body["input"], service.vision)
    questions = [parse_question(refuse, q, f"questions[{i}]")
                 for i, q in enumerate(refuse.items(body["questions"], "questions", 1, 64))]
    tokens = labels_of(service)
    prompts, media = await prompts_of(service, given, [q for q, _ in questions], deadline, "input", DECISIONS_STATUS)
    label_ids = [tuple(tokens[q.kind][label] for label in q.labels) for q, _ in questions]
    result = await run(service, prompts, label_ids, deadline, media)
    answers = [answer(q, name, probabilities(read)) for (q, name), read in zip(questions, result.reads)]
    return {"id": f"dec_{uuid.uuid4().hex[:24]}", "object": "decision", "created": int(time.time()), "model": model,
            "answers": answers,
            "usage": {"input_tokens": result.input_tokens, "input_tokens_details": {"cached_tokens": result.cached_tokens},
                      "output_tokens": 0, "total_tokens": result.input_tokens}}


def answer(question: Question, name: str | None, p) -> dict:
    if question.kind == "predicate":
        return {"type": "predicate", "name": name, "probability": p.p[0]}
    if question.kind == "choice":
        values = [o.name if o.value is None else o.value for o in question.options]
        return {"type": "choice", "name": name, "choice": values[p.top], "confidence": p.confidence,
                "probabilities": [{"value": v, "probability": x} for v, x in zip(values, p.p)]}
    return {"type": "score", "name": name, "score": score_value(p.p), "confidence": p.confidence,
            "probabilities": [{"value": i, "label": o.name, "probability": x} for i, (o, x) in enumerate(zip(question.options, p.p))]}


# ---- /v1/systemone ----

def parse_systemone_question(refuse: Refuse, raw: Any, at: str) -> Question:
    body = refuse.fields(raw, at, {"type", "instructions", "criteria"}, {"type", "instructions"})
    kind, instructions = body["type"], entry_text(body["instructions"])
    criteria = body.get("criteria")
    if kind == "noul":
        c = refuse.fields(criteria or {}, f"{at}.criteria", {"true", "false"}, set())
        return Question("predicate", instructions, (Option("true", entry_text(c["true"]) if "true" in c else None),
                                                     Option("false", entry_text(c["false"]) if "false" in c else None)))
    if kind == "choice":
        c = refuse.items(criteria, f"{at}.criteria", 2, 26, dict)
        return Question("choice", instructions, tuple(Option(k, None if v is None else entry_text(v)) for k, v in c.items()))
    if kind == "score":
        levels = refuse.items(criteria, f"{at}.criteria", 2, 10)
        return Question("score", instructions, tuple(Option(entry_text(v)) for v in levels))
    raise refuse(f"{at}.type", f"'{at}.type' must be one of noul, choice, score")


async def systemone(service: Service, body: dict) -> dict:
    refuse = Refuse(SYSTEMONE_STATUS)
    refuse.fields(body, "", {"model", "state", "questions", "assets"}, {"state", "questions"})
    model = served_model(service, refuse.string(body.get("model", service.model_name), "model"))
    deadline = trio.current_time() + service.decision_timeout  # fetching its assets counts toward it
    if body.get("assets") and not service.vision:
        raise errors.vision_off("assets", SYSTEMONE_STATUS)
    state = body["state"]
    if not isinstance(state, (str, dict, list)):
        raise refuse("state", "'state' must be a string, an object or an array")
    given = place_assets(refuse, body.get("assets"), entry_text(state))
    raw = refuse.items(body["questions"], "questions", 1, 64, dict)
    questions = {qid: parse_systemone_question(refuse, q, f"questions.{qid}") for qid, q in raw.items()}
    tokens = labels_of(service)
    prompts, media = await prompts_of(service, given, list(questions.values()), deadline, "state", SYSTEMONE_STATUS)
    label_ids = [tuple(tokens[q.kind][label] for label in q.labels) for q in questions.values()]
    result = await run(service, prompts, label_ids, deadline, media)
    answers = {qid: systemone_answer(q, probabilities(read)) for (qid, q), read in zip(questions.items(), result.reads)}
    return {"id": f"s1_{uuid.uuid4().hex[:24]}", "object": "systemone.decision", "created": int(time.time()),
            "model": model, "answers": answers, "usage": {"input_tokens": result.input_tokens, "output_tokens": 0}}


def systemone_answer(question: Question, p) -> dict:
    if question.kind == "predicate":
        return {"type": "noul", "noul": p.p[0], "confidence": p.confidence, "probabilities": {"yes": p.p[0], "no": p.p[1]}}
    if question.kind == "choice":
        names = [o.name for o in question.options]
        return {"type": "choice", "choice": names[p.top], "confidence": p.confidence,
                "probabilities": dict(zip(names, p.p))}
    return {"type": "score", "score": score_value(p.p), "confidence": p.confidence,
            "legend": {str(i): o.name for i, o in enumerate(question.options)},
            "probabilities": {str(i): x for i, x in enumerate(p.p)}}
