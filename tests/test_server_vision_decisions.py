"""Decisions over images through the server: `input_image` parts of /v1/decisions and System One's `assets`
answered as transformers answers them, a trunk with images answering as independent reads do, the prompt
cache keyed by the images, bad assets refused with 422, and images refused by name without --vision.

Rules: a tiny random Qwen2-VL built in the test (tests/tiny_vl.py) whose tokenizer makes yes/no, A..Z and
0..9 single tokens, on the CPU in fp32; httpx against a live server on 127.0.0.1 port 0; references from
transformers' forward on the very token ids our prompts render to, its pixels from its own image processor,
within 1e-4; every test under `trio.fail_after`; the lane core's books checked when each server stops.
"""

import base64
import io

import httpx
import numpy as np
import pytest
import torch
import trio
from PIL import Image

import tiny_vl
from lanes.core.decider import common_prefix, shared_trunk
from lanes.core.lane_core import LaneCore
from lanes.core.media import PromptMedia
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner, choose
from lanes.http.decision_prompts import Option, Question, find_label_tokens, render
from lanes.http.media_fetch import MediaFetcher
from lanes.http.service import Service
from lanes.http.vision_inputs import VisionInputs
from lanes.loader import load_model
from lanes.vision.qwen_image import VisionParams
from server_helpers import serving
from test_server_decisions import QUESTIONS  # the same questions as the text-only decisions

PARAMS = VisionParams(min_pixels=28 * 28, max_pixels=28 * 28 * 64)  # as tiny_vl's preprocessor_config.json
BLOCK = 16
VISION_OFF = "image and video inputs need a server started with --vision"
MODEL_QUESTIONS = [
    Question("predicate", QUESTIONS[0]["instructions"], (Option("true"), Option("false"))),
    Question("choice", QUESTIONS[1]["instructions"], (Option("mat", "on the floor"), Option("hat"), Option("true"))),
    Question("score", QUESTIONS[2]["instructions"], (Option("restless"), Option("calm", "sitting"), Option("asleep"))),
]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-vl-labels")
    reference, ids = tiny_vl.build("qwen2_vl", folder, labels=True)
    model = load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True, vision=True)
    return reference, ids, model


def decider(model, vision: bool = True, cache_blocks: int = 0) -> Service:
    backend = TorchBackend(model, CpuRunner(), lanes=4, max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), (), max_rows=64,
                    cache_bytes=cache_blocks * backend.shape.bytes_per_block)
    inputs = VisionInputs(MediaFetcher(), model.vision_tokens, image=PARAMS, video=PARAMS) if vision else None
    return Service(core, model.tokenizer, "tiny-vl", "qwen2_vl", 1024, vocab_size=model.config.vocab_size,
                   vision=vision, vision_inputs=inputs, decides=True)


def picture(seed: int, size=(90, 60), fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_input(image: bytes, before: str = "the cat", after: str = " sat on the mat in the hat") -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": before},
                                         {"type": "input_image", "image_url": data_url(image), "detail": "high"},
                                         {"type": "input_text", "text": after}]}]


def state_parts(before: str = "the cat", after: str = " sat on the mat in the hat") -> list[dict]:
    """What `image_input` renders as: the template's parts of the state."""
    return [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]


def pixels_of(images: list[bytes]):
    """transformers' own pixel values and grids for `images`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=PARAMS.min_pixels, max_pixels=PARAMS.max_pixels)
    return processor(images=[Image.open(io.BytesIO(i)).convert("RGB") for i in images], return_tensors="pt")


def expanded(model, ids, parts, question: Question, grids) -> list[int]:
    """The rendered prompt with each image's placeholder repeated for its merged patches."""
    rows = iter(int(g.prod()) // 4 for g in grids)
    out = []
    for token in render(model.tokenizer, None, parts, question):
        out += [token] * (next(rows) if token == ids["<|image_pad|>"] else 1)
    return out


def reference_probabilities(reference, ids, model, images: list[bytes], parts, question: Question) -> list[float]:
    """transformers' softmax over the label logits at the row after the prompt."""
    out = pixels_of(images)
    prompt = torch.tensor([expanded(model, ids, parts, question, out["image_grid_thw"])])
    types = (prompt == ids["<|image_pad|>"]).long()
    reference.model.rope_deltas = None
    with torch.no_grad():
        row = reference(input_ids=prompt, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                        mm_token_type_ids=types).logits[0, -1]
    labels = find_label_tokens(model.tokenizer)[question.kind]
    return torch.softmax(row[[labels[label] for label in question.labels]].double(), dim=0).tolist()


def probabilities(answer: dict) -> list[float]:
    if answer["type"] == "predicate":
        return [answer["probability"]]
    return [p["probability"] for p in answer["probabilities"]]


async def decide(http: httpx.AsyncClient, given, questions=QUESTIONS) -> dict:
    reply = await http.post("/v1/decisions", json={"model": "tiny-vl", "input": given, "questions": questions})
    assert reply.status_code == 200, reply.text
    return reply.json()


def image_rows(prompt: list[int], pad: int) -> tuple[int, int]:
    first = prompt.index(pad)
    return first, len(prompt) - prompt[::-1].index(pad)


def test_a_trunk_never_ends_inside_an_image():
    prompts = [tuple(range(60)) + (100 + q,) for q in range(3)]
    inside = PromptMedia("image", 10, 20, (1, 4, 20), None, b"a")  # rows 10..30
    across = PromptMedia("image", 40, 12, (1, 4, 12), None, b"b")  # rows 40..52, cut by the 48-token trunk
    assert len(shared_trunk(prompts, BLOCK, (inside,))) == 48
    assert len(shared_trunk(prompts, BLOCK, (inside, across))) == 32  # ends before the image it would cut
    before = PromptMedia("image", 20, 14, (1, 4, 14), None, b"c")  # rows 20..34: cut by a trunk ending at 32
    assert len(shared_trunk(prompts, BLOCK, (before, across))) == 16
    assert common_prefix(prompts) == 60


async def test_probabilities_over_an_image_equal_transformers_for_predicate_choice_and_score(vl):
    reference, ids, model = vl
    image = picture(1)
    with trio.fail_after(120):
        async with serving(decider(model)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                reply = await decide(http, image_input(image))
        for answer, question in zip(reply["answers"], MODEL_QUESTIONS):
            expected = reference_probabilities(reference, ids, model, [image], state_parts(), question)
            predicate = question.kind == "predicate"
            got = [answer["probability"], 1 - answer["probability"]] if predicate else probabilities(answer)
            assert got == pytest.approx(expected, abs=1e-4), question.kind
    grids = pixels_of([image])["image_grid_thw"]
    prompts = [expanded(model, ids, state_parts(), q, grids) for q in MODEL_QUESTIONS]
    trunk = shared_trunk(prompts, BLOCK)
    assert reply["usage"]["input_tokens"] == len(trunk) + sum(len(p) - len(trunk) for p in prompts)
    assert image_rows(prompts[0], ids["<|image_pad|>"])[1] <= len(trunk)  # the image's rows ran in the trunk


@pytest.mark.parametrize("before", ["the cat", "the cat sat"])
async def test_a_trunk_and_branches_over_an_image_answer_as_independent_reads(vl, before):
    _, ids, model = vl
    image = picture(2, size=(112, 112))
    given = image_input(image, before=before, after="")
    grids = pixels_of([image])["image_grid_thw"]
    prompts = [expanded(model, ids, state_parts(before, ""), q, grids) for q in MODEL_QUESTIONS]
    start, end = image_rows(prompts[0], ids["<|image_pad|>"])
    cut = start < len(shared_trunk(prompts, BLOCK)) < end  # a trunk in whole blocks would end inside the image
    assert cut == (before != "the cat")  # both cases: the image inside the trunk, and a trunk cut short before it
    service = decider(model, cache_blocks=64)
    with trio.fail_after(120):
        async with serving(service) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                together = await decide(http, given)
                alone = [await decide(http, given, [q]) for q in QUESTIONS]
            assert not any(service.core.backend.vision.bound(lane) for lane in range(4))  # every bound lane let go
    assert together["usage"]["input_tokens"] < sum(a["usage"]["input_tokens"] for a in alone)  # the trunk once
    for joint, single in zip(together["answers"], alone):
        assert probabilities(joint) == pytest.approx(probabilities(single["answers"][0]), abs=1e-5)


async def test_the_cache_keys_a_trunk_by_its_images(vl):
    _, ids, model = vl
    first, second = picture(3), picture(4)
    grids = pixels_of([first])["image_grid_thw"]
    prompts = [expanded(model, ids, state_parts(), q, grids) for q in MODEL_QUESTIONS]
    trunk = len(shared_trunk(prompts, BLOCK))
    start, end = image_rows(prompts[0], ids["<|image_pad|>"])
    assert BLOCK <= start and end < trunk
    with trio.fail_after(120):
        async with serving(decider(model, cache_blocks=64)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                replies = [await decide(http, image_input(image)) for image in (first, first, second)]
    cached = [r["usage"]["input_tokens_details"]["cached_tokens"] for r in replies]
    assert cached[0] == 0
    assert cached[1] == (trunk - 1) // BLOCK * BLOCK  # the same image: every full block of the trunk but its last row's
    assert cached[2] == start // BLOCK * BLOCK  # another image: only the blocks before its rows
    assert replies[2]["answers"] != replies[0]["answers"]


async def test_systemone_puts_each_asset_after_its_key_and_answers_as_decisions_do(vl):
    _, _, model = vl
    photo, sketch = picture(5), picture(6, fmt="JPEG")
    state = "first the photo, then the sketch, then the photo again"
    assets = {"sketch": {"type": "image", "format": "jpeg", "data_base64": base64.b64encode(sketch).decode()},
              "photo": {"type": "image", "format": "png", "data_base64": base64.b64encode(photo).decode()}}
    as_parts = [{"role": "user", "content": [
        {"type": "input_text", "text": "first the photo"}, {"type": "input_image", "image_url": data_url(photo)},
        {"type": "input_text", "text": ", then the sketch"},
        {"type": "input_image", "image_url": data_url(sketch, "image/jpeg")},
        {"type": "input_text", "text": ", then the photo again"}]}]
    with trio.fail_after(120):
        async with serving(decider(model)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                s1 = await http.post("/v1/systemone", json={"state": state, "assets": assets, "questions": {
                    "x": {"type": "noul", "instructions": QUESTIONS[0]["instructions"]}}})
                decided = await decide(http, as_parts, QUESTIONS[:1])
    assert s1.status_code == 200, s1.text
    assert s1.json()["usage"]["input_tokens"] == decided["usage"]["input_tokens"]
    assert s1.json()["answers"]["x"]["noul"] == pytest.approx(decided["answers"][0]["probability"], abs=1e-6)


async def test_bad_assets_and_images_are_refused_by_name_and_the_server_is_unharmed(vl):
    _, _, model = vl
    noul = {"x": {"type": "noul", "instructions": "Is it?"}}

    def asset(data: str, fmt: str = "png") -> dict:
        return {"type": "image", "format": fmt, "data_base64": data}

    junk = base64.b64encode(b"certainly not a picture").decode()
    with trio.fail_after(120):
        async with serving(decider(model)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                async def systemone(assets: dict, state: str = "see the photo") -> httpx.Response:
                    return await http.post("/v1/systemone", json={"state": state, "assets": assets, "questions": noul})

                missing = await systemone({"drawing": asset(junk)})
                unreadable = await systemone({"photo": asset(junk)})
                not_base64 = await systemone({"photo": asset("@@@@")})
                wrong_format = await systemone({"photo": asset(junk, "gif")})
                bad_image = await http.post("/v1/decisions", json={"model": "tiny-vl", "input": image_input(b"junk"),
                                                                   "questions": QUESTIONS[:1]})
                in_system = await http.post("/v1/decisions", json={"model": "tiny-vl", "questions": QUESTIONS[:1], "input": [
                    {"role": "system", "content": [{"type": "input_image", "image_url": data_url(picture(7))}]},
                    {"role": "user", "content": "the cat"}]})
                answered = await http.post("/v1/systemone", json={"state": "see the photo", "questions": noul, "assets": {
                    "photo": asset(base64.b64encode(picture(8)).decode())}})
    assert (missing.status_code, missing.json()["error"]) == (422, {
        "message": "the asset key 'drawing' does not appear in 'state'", "type": "invalid_request_error",
        "param": "assets.drawing", "code": "invalid_request"})
    assert (unreadable.status_code, unreadable.json()["error"]) == (422, {
        "message": "the image could not be decoded as JPEG or PNG", "type": "invalid_request_error",
        "param": "assets.photo.data_base64", "code": "image_unreadable"})
    assert (not_base64.status_code, not_base64.json()["error"]["code"]) == (422, "bad_data_url")
    assert (wrong_format.status_code, wrong_format.json()["error"]["message"]) == (422, "'assets.photo.format' must be png or jpeg")
    assert (bad_image.status_code, bad_image.json()["error"]["code"]) == (400, "image_unreadable")
    assert bad_image.json()["error"]["param"] == "input[0].content[1].image_url"
    assert (in_system.status_code, in_system.json()["error"]["message"]) == (
        400, "'input[0].content[0]' is an image outside a user message; images go in user messages")
    assert answered.status_code == 200, answered.text


async def test_without_vision_both_endpoints_refuse_images_with_the_vision_off_words(vl):
    _, _, model = vl
    with trio.fail_after(120):
        async with serving(decider(model, vision=False)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                decided = await http.post("/v1/decisions", json={"model": "tiny-vl", "input": image_input(picture(9)),
                                                                 "questions": QUESTIONS[:1]})
                s1 = await http.post("/v1/systemone", json={"state": "see the photo", "questions": {
                    "x": {"type": "noul", "instructions": "Is it?"}}, "assets": {
                    "photo": {"type": "image", "format": "png", "data_base64": base64.b64encode(picture(9)).decode()}}})
                text_only = await decide(http, "the cat", QUESTIONS[:1])
    assert (decided.status_code, decided.json()["error"]["message"]) == (400, VISION_OFF)
    assert decided.json()["error"]["param"] == "input[0].content[1]"
    assert (s1.status_code, s1.json()["error"]["message"], s1.json()["error"]["param"]) == (422, VISION_OFF, "assets")
    assert text_only["answers"][0]["type"] == "predicate"
