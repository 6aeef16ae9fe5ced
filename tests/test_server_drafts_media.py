"""Drafts beside images and decisions: a drafting server given text streams that draft, chats with an image,
and decisions over text and over an image, all at once, answers each exactly as the same server without
drafts; text streams draft, and no draft is made for a stream with media in its prompt.

Rules: a tiny random Qwen2-VL built in the test (tests/tiny_vl.py) on the CPU in fp32; the official `openai`
client and httpx against a live server on 127.0.0.1 port 0; the reference is the same server without drafts;
fixed draft lengths (load control learns from wall-clock times, which a test must not depend on); every test
under `trio.fail_after`; the lane core's books checked when each server stops (server_helpers.serving).
"""

import pytest
import trio
import httpx

import tiny_vl
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.lane_core import LaneCore
from lanes.drafts.ngram import NgramDrafter
from lanes.gpu.device import CpuRunner, choose
from lanes.http.media_fetch import MediaFetcher
from lanes.http.service import Service
from lanes.http.vision_inputs import VisionInputs
from lanes.loader import load_model
from lanes.vision.qwen_image import VisionParams
from server_helpers import client, serving
from test_server_decisions import QUESTIONS, STATE
from test_server_vision_decisions import data_url, image_input, picture, probabilities

PARAMS = VisionParams(min_pixels=28 * 28, max_pixels=28 * 28 * 64)  # as tiny_vl's preprocessor_config.json


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-vl-drafts")
    tiny_vl.build("qwen2_vl", folder, labels=True)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=300, quiet=True, vision=True)


def service(model, drafts) -> Service:
    backend = TorchBackend(model, CpuRunner(), lanes=4, max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), (), max_rows=64, drafts=drafts, draft_tokens=4,
                    draft_control=False)
    inputs = VisionInputs(MediaFetcher(), model.vision_tokens, image=PARAMS, video=PARAMS)
    return Service(core, model.tokenizer, "tiny-vl", "qwen2_vl", 1024, vocab_size=model.config.vocab_size,
                   vision=True, vision_inputs=inputs, decides=True)


def image_chat(seed: int, bias: int) -> dict:
    content = [{"type": "image_url", "image_url": {"url": data_url(picture(seed))}}, {"type": "text", "text": "the hat"}]
    return dict(messages=[{"role": "user", "content": content}], max_tokens=20, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"logit_bias": {str(bias): 100}})


def text_completion(prompt: str, bias: int) -> dict:
    # a bias repeats one token, so the stream's own n-grams draft it
    return dict(prompt=prompt, max_tokens=24, temperature=0, logprobs=2, extra_body={"logit_bias": {str(bias): 100}})


async def answers(service: Service) -> dict:
    """Every request at once: two text streams, two image chats, a decision over text and one over an image."""
    found: dict = {}
    async with serving(service) as url:
        api = client(url, timeout=60)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def completion(name, body):
                found[name] = await trio.to_thread.run_sync(lambda: api.completions.create(model="tiny-vl", **body))

            async def chat(name, body):
                found[name] = await trio.to_thread.run_sync(lambda: api.chat.completions.create(model="tiny-vl", **body))

            async def decision(name, given):
                reply = await http.post("/v1/decisions", json={"model": "tiny-vl", "input": given, "questions": QUESTIONS})
                assert reply.status_code == 200, reply.text
                found[name] = reply.json()

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i, prompt in enumerate(["the cat sat", "a hat on the mat"]):
                        nursery.start_soon(completion, f"text {i}", text_completion(prompt, 20 + i))
                    for i in range(2):
                        nursery.start_soon(chat, f"image {i}", image_chat(5 + i, 30 + i))
                    nursery.start_soon(decision, "decision", STATE)
                    nursery.start_soon(decision, "image decision", image_input(picture(7)))
    found["drafts"] = service.core.statistics().drafts
    return found


async def test_drafts_beside_images_and_decisions_change_no_answer(model):
    plain = await answers(service(model, None))
    drafting = NgramDrafter()
    asked: list[int] = []  # how many media each stream had when its source was asked for a draft
    propose = drafting.propose
    drafting.propose = lambda job, most: asked.append(len(job.media)) or propose(job, most)
    drafted = await answers(service(model, drafting))
    for name in ("text 0", "text 1"):
        got, want = drafted[name].choices[0], plain[name].choices[0]
        assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-5)
    for name in ("image 0", "image 1"):
        got, want = drafted[name].choices[0], plain[name].choices[0]
        assert got.message.content == want.message.content
        assert [t.logprob for t in got.logprobs.content] == pytest.approx([t.logprob for t in want.logprobs.content], abs=1e-5)
    for name in ("decision", "image decision"):
        for got, want in zip(drafted[name]["answers"], plain[name]["answers"], strict=True):
            assert got["type"] == want["type"]
            assert probabilities(got) == pytest.approx(probabilities(want), abs=1e-5)
    assert drafted["drafts"].accepted > 0  # the text streams drafted, and kept drafts
    assert asked and not any(asked)  # the source was never asked for a stream with an image in its prompt
