"""Constrained output through a live server, on tiny random models: every way to ask for it (response_format
json_object and json_schema, vLLM's guided_* fields and structured_outputs) holds the text to its grammar,
streamed as not; and it works beside the prompt cache, decisions and images.

Rules: live servers on 127.0.0.1 port 0 over tiny checkpoints built here (byte-level tokenizers, so any
text can be written); references are `json.loads`, `jsonschema`, `re.fullmatch` and a solo run of the same
request; the lane core's books checked when each server stops; every test under `trio.fail_after`.
"""

import json
import re

import httpx
import jsonschema
import pytest
import trio

import tiny
import tiny_vl
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.lane_core import LaneCore
from lanes.gpu.device import CpuRunner, choose
from lanes.grammar.engine import GrammarEngine
from lanes.http.media_fetch import MediaFetcher
from lanes.http.service import Service
from lanes.http.vision_inputs import VisionInputs
from lanes.loader import load_model
from server_helpers import serving
from test_server_vision import PARAMS, image_message, png

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "kind": {"enum": ["cat", "hat", "mat"]}},
          "required": ["name", "size", "kind"], "additionalProperties": False}
HELD = {
    "json_object": ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                               "schema": SCHEMA}}},
                    lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "guided_json": ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    "guided_regex": ({"guided_regex": "(the|a) [a-z]{1,8}( [0-9]{1,3})?"},
                     lambda t: re.fullmatch("(the|a) [a-z]{1,8}( [0-9]{1,3})?", t) is not None),
    "guided_choice": ({"guided_choice": ["on the mat", "in the hat", "a cat"]},
                      lambda t: t in ("on the mat", "in the hat", "a cat")),
    "guided_grammar": ({"guided_grammar": 'start: "cat" ("," " " "cat")*\n'}, lambda t: re.fullmatch("cat(, cat)*", t)),
    "structured_outputs": ({"structured_outputs": {"regex": "[0-9]{2,5}"}}, lambda t: re.fullmatch("[0-9]{2,5}", t)),
}

# An open object lets a random model write a key without end; these seeds close theirs within max_tokens.
SEEDS = {"json_object": (2, 3)}


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-structured")
    tiny.build("qwen2", folder, labels=True, max_position_embeddings=1024)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=400, quiet=True)


def service(model, cache_blocks: int = 0, **options) -> Service:
    stops = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    engine = GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, stops)
    backend = TorchBackend(model, CpuRunner(), lanes=4, max_model_len=1024, grammars=engine.matcher)
    core = LaneCore(backend, text_factory(model.tokenizer), stops, max_rows=128,
                    cache_bytes=cache_blocks * backend.shape.bytes_per_block)
    return Service(core, model.tokenizer, "tiny", model.config.family, 1024, vocab_size=model.config.vocab_size,
                   grammars=engine, **options)


def streamed_text(lines: list[str], chat: bool) -> tuple[str, str]:
    text, reason = "", None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        text += (choice["delta"].get("content") or "") if chat else choice["text"]
        reason = choice.get("finish_reason") or reason
    return text, reason


@pytest.mark.parametrize("kind", list(HELD))
async def test_each_way_to_ask_holds_the_answer_streamed_and_not(labelled, kind):
    extra, holds = HELD[kind]
    async with serving(service(labelled)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(120):
                for seed in SEEDS.get(kind, range(3)):
                    chat = {"messages": [{"role": "user", "content": f"the cat {seed}"}], "max_tokens": 120,
                            "temperature": 0.8, "seed": seed, **extra}
                    plain = {"prompt": f"a hat {seed}", "max_tokens": 120, "temperature": 0.8, "seed": seed, **extra}
                    whole = (await http.post(CHAT, json=chat)).json()["choices"][0]
                    assert holds(whole["message"]["content"]) and whole["finish_reason"] == "stop", whole
                    done = (await http.post("/v1/completions", json=plain)).json()["choices"][0]
                    assert holds(done["text"]) and done["finish_reason"] == "stop", done
                    async with http.stream("POST", CHAT, json={**chat, "stream": True}) as answer:
                        lines = [line async for line in answer.aiter_lines()]
                    assert streamed_text(lines, True) == (whole["message"]["content"], "stop")


async def test_constrained_streams_share_the_prompt_cache_and_run_beside_decisions(labelled):
    extra, holds = HELD["json_schema"]
    long = "the cat sat on the mat in the hat " * 8
    bodies = [{"prompt": long + str(i % 2), "max_tokens": 80, "temperature": 0, **extra} for i in range(4)]
    decide = {"model": "tiny", "input": "the cat sat on the mat", "questions": [
        {"type": "predicate", "instructions": "Is the cat on the mat?", "name": "on_mat"}]}
    async with serving(service(labelled, cache_blocks=64, decides=True)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(120):
                solo_decision = (await http.post("/v1/decisions", json=decide)).json()
                solo = [(await http.post("/v1/completions", json=b)).json() for b in bodies[:2]]
                together: list = [None] * (len(bodies) + 1)

                async def ask(i, path, body):
                    together[i] = (await http.post(path, json=body)).json()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, len(bodies), "/v1/decisions", decide)
                    for i, body in enumerate(bodies):
                        nursery.start_soon(ask, i, "/v1/completions", body)
    (alone,), (beside,) = solo_decision["answers"], together[-1]["answers"]
    assert beside["probability"] == pytest.approx(alone["probability"], abs=1e-5)
    for i, reply in enumerate(together[:-1]):
        assert reply["choices"][0]["text"] == solo[i % 2]["choices"][0]["text"] and holds(reply["choices"][0]["text"])
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_constrained_answer_about_an_image(tmp_path):
    _, _ = tiny_vl.build("qwen2_vl", tmp_path)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=200, quiet=True, vision=True)
    inputs = VisionInputs(MediaFetcher(), model.vision_tokens, image=PARAMS, video=PARAMS)
    extra, holds = HELD["guided_choice"]
    async with serving(service(model, vision=True, vision_inputs=inputs)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(120):
                for seed in range(2):
                    body = {"messages": image_message(png(seed)), "max_tokens": 20, "temperature": 1.0, "seed": seed,
                            **extra}
                    answer = (await http.post(CHAT, json=body)).json()
                    assert holds(answer["choices"][0]["message"]["content"]), answer
                    assert answer["usage"]["prompt_tokens"] > 40
