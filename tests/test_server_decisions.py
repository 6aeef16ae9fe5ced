"""/v1/decisions and /v1/systemone through a live server: probabilities equal transformers' softmax over
the label logits of the same rendered prompts; input as messages and state as JSON render as the spec says;
a trunk with branches answers as independent reads do; a model whose labels are not single tokens gets 501
by name.

Rules: live servers on 127.0.0.1 port 0 (with decisions on); a tiny random model built in the test whose
tokenizer makes yes/no, A..Z and 0..9 single tokens; references from transformers' forward on the very
token ids our prompts render to; within 1e-4; every test under `trio.fail_after`; the lane core's books
checked when each server stops.
"""

import json

import httpx
import pytest
import torch

import tiny
from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner, choose
from lanes.http.decision_prompts import Option, Question, find_label_tokens, render
from lanes.http.service import Service
from lanes.loader import load_model
from server_helpers import serving

STATE = "the cat sat on the mat in the hat"
QUESTIONS = [
    {"type": "predicate", "instructions": "Is the cat on the mat?", "name": "on_mat"},
    {"type": "choice", "instructions": "Where is the cat?", "choices": [
        {"value": "mat", "description": "on the floor"}, {"value": "hat"}, {"value": True}]},
    {"type": "score", "instructions": "How calm is the cat?", "name": "calm", "levels": [
        {"label": "restless"}, {"label": "calm", "description": "sitting"}, {"label": "asleep"}]},
]


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-labels")
    reference = tiny.build("qwen2", folder, labels=True, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True), reference


def decider(model, **options) -> Service:
    backend = TorchBackend(model, CpuRunner(), lanes=4, max_model_len=512)
    core = LaneCore(backend, text_factory(model.tokenizer), (), max_rows=64, **options)
    return Service(core, model.tokenizer, "tiny", "qwen2", 512, vocab_size=model.config.vocab_size, decides=True)


def reference_probabilities(model, reference, question: Question, system: str | None = None) -> list[float]:
    labels = find_label_tokens(model.tokenizer)[question.kind]
    ids = render(model.tokenizer, system, STATE, question)
    with torch.no_grad():
        row = reference(torch.tensor([ids])).logits[0, -1]
    picked = row[[labels[label] for label in question.labels]]
    return torch.softmax(picked.double(), dim=0).tolist()


async def test_probabilities_equal_transformers_for_predicate_choice_and_score(model_and_reference):
    model, reference = model_and_reference
    async with serving(decider(model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            reply = (await http.post("/v1/decisions", json={"model": "tiny", "input": STATE, "questions": QUESTIONS})).json()
    predicate, choice, score = reply["answers"]
    expected = reference_probabilities(model, reference, Question("predicate", QUESTIONS[0]["instructions"],
                                                                  (Option("true"), Option("false"))))
    assert predicate["name"] == "on_mat" and predicate["probability"] == pytest.approx(expected[0], abs=1e-4)
    expected = reference_probabilities(model, reference, Question("choice", QUESTIONS[1]["instructions"], (
        Option("mat", "on the floor"), Option("hat"), Option("true"))))
    assert [p["probability"] for p in choice["probabilities"]] == pytest.approx(expected, abs=1e-4)
    assert [p["value"] for p in choice["probabilities"]] == ["mat", "hat", True] and choice["name"] is None
    assert choice["choice"] == ["mat", "hat", True][max(range(3), key=expected.__getitem__)]
    expected = reference_probabilities(model, reference, Question("score", QUESTIONS[2]["instructions"], (
        Option("restless"), Option("calm", "sitting"), Option("asleep"))))
    assert [p["probability"] for p in score["probabilities"]] == pytest.approx(expected, abs=1e-4)
    assert score["score"] == pytest.approx(sum(i * p for i, p in enumerate(expected)), abs=1e-4)
    assert reply["usage"]["output_tokens"] == 0 and reply["object"] == "decision"


async def test_input_as_messages_and_state_as_json_are_answered_as_the_text_they_render_to(model_and_reference):
    model, reference = model_and_reference
    ask = QUESTIONS[0]
    question = Question("predicate", ask["instructions"], (Option("true"), Option("false")))
    state = {"cat": "on the mat", "où": ["là", 1, None]}
    state_text = json.dumps(state, ensure_ascii=False)
    parts = [{"type": "input_text", "text": "the cat sat"}, {"type": "input_text", "text": " on the mat in the hat"}]
    async with serving(decider(model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def decide(given) -> dict:
                return (await http.post("/v1/decisions", json={"model": "tiny", "input": given, "questions": [ask]})).json()

            as_text = await decide(STATE)
            as_parts = await decide([{"role": "user", "content": parts}])
            with_system = await decide([{"role": "system", "content": "Be brief."}, {"role": "user", "content": STATE}])
            json_as_text = await decide(state_text)
            as_json = (await http.post("/v1/systemone", json={"state": state, "questions": {
                "x": {"type": "noul", "instructions": ask["instructions"]}}})).json()
    assert as_parts["answers"] == as_text["answers"] and as_parts["usage"] == as_text["usage"]
    assert with_system["usage"]["input_tokens"] == len(render(model.tokenizer, "Be brief.", STATE, question))
    expected = reference_probabilities(model, reference, question, system="Be brief.")
    assert with_system["answers"][0]["probability"] == pytest.approx(expected[0], abs=1e-4)
    assert with_system["answers"][0]["probability"] != as_text["answers"][0]["probability"]  # the system turn counts
    assert as_json["usage"]["input_tokens"] == json_as_text["usage"]["input_tokens"] == \
        len(render(model.tokenizer, None, state_text, question))
    assert as_json["answers"]["x"]["noul"] == json_as_text["answers"][0]["probability"]


async def test_a_trunk_with_branches_answers_as_independent_reads_and_systemone_agrees(model_and_reference):
    model, _ = model_and_reference
    async with serving(decider(model, cache_bytes=1 << 30)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            together = (await http.post("/v1/decisions", json={"model": "tiny", "input": STATE, "questions": QUESTIONS})).json()
            alone = [(await http.post("/v1/decisions", json={"model": "tiny", "input": STATE, "questions": [q]})).json()
                     for q in QUESTIONS]
            s1 = (await http.post("/v1/systemone", json={"state": STATE, "questions": {
                "x": {"type": "noul", "instructions": QUESTIONS[0]["instructions"]}}})).json()
    assert together["usage"]["input_tokens"] < sum(a["usage"]["input_tokens"] for a in alone)  # the trunk once
    for joint, single in zip(together["answers"], alone):
        single = single["answers"][0]
        if joint["type"] == "predicate":
            assert joint["probability"] == pytest.approx(single["probability"], abs=1e-5)
        else:
            assert [p["probability"] for p in joint["probabilities"]] == pytest.approx(
                [p["probability"] for p in single["probabilities"]], abs=1e-5)
    assert s1["answers"]["x"]["noul"] == pytest.approx(together["answers"][0]["probability"], abs=1e-5)
    assert s1["object"] == "systemone.decision"


async def test_a_model_whose_labels_are_not_single_tokens_gets_501_and_bad_bodies_their_codes(tmp_path):
    tiny.build("llama", tmp_path)  # its tokenizer spells "yes" in three tokens
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=32, quiet=True)
    async with serving(decider(model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            refused = await http.post("/v1/decisions", json={"model": "tiny", "input": "x", "questions": QUESTIONS[:1]})
            bad = await http.post("/v1/decisions", json={"model": "tiny", "input": "x", "questions": [
                {"type": "predicate", "instructions": "?", "name": None}]})
            unprocessable = await http.post("/v1/systemone", json={"state": "x", "questions": {"q": {"type": "maybe", "instructions": "?"}}})
    assert refused.status_code == 501
    assert refused.json()["error"]["message"] == "decisions are not available for this model: the label 'yes' is not one token after the generation prompt"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "questions[0].name"
    assert unprocessable.status_code == 422 and unprocessable.json()["error"]["param"] == "questions.q.type"


async def test_live_streams_keep_their_solo_tokens_while_decisions_run_beside_them(model_and_reference):
    import trio

    model, _ = model_and_reference
    bodies = [{"messages": [{"role": "user", "content": f"story {i} of the cat"}], "temperature": 0,
               "max_tokens": 12, "ignore_eos": True} for i in range(4)]
    decision = {"model": "tiny", "input": STATE, "questions": QUESTIONS}
    service = decider(model)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            solo = [(await http.post("/v1/chat/completions", json=b)).json()["choices"][0]["message"]["content"] for b in bodies]
            together: dict[int, str] = {}

            async def stream(i):
                reply = await http.post("/v1/chat/completions", json=bodies[i])
                together[i] = reply.json()["choices"][0]["message"]["content"]

            async def decide():
                assert (await http.post("/v1/decisions", json=decision)).status_code == 200

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(stream, i)
                for _ in range(3):
                    nursery.start_soon(decide)
    assert [together[i] for i in range(4)] == solo
    assert service.core.decider.counts["answered"] == 3
