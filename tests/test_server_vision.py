"""Images and videos through the server: data URLs answered as transformers answers them, the prompt cache
keyed by image content, bad media refused with 400 and the server unharmed.

Rules: a tiny random Qwen2-VL built in the test (tests/tiny_vl.py) on the CPU in fp32; the official
`openai` client and httpx against a live server on 127.0.0.1 port 0; the reference for pixels is
transformers' own image processor, for tokens transformers' forward; every test under `trio.fail_after`;
the lane core's books checked when each server stops (server_helpers.serving).
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
from lanes.core.lane_core import LaneCore
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import CpuRunner, choose
from lanes.http.media_fetch import MediaFetcher
from lanes.http.service import Service
from lanes.http.vision_inputs import VisionInputs
from lanes.loader import load_model
from lanes.vision.measure import measure_image, measure_video
from lanes.vision.qwen_image import VisionParams
from server_helpers import client, serving

CHAT = "/v1/chat/completions"
PARAMS = VisionParams(min_pixels=28 * 28, max_pixels=28 * 28 * 64)  # as tiny_vl's preprocessor_config.json


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-vl")
    reference, ids = tiny_vl.build("qwen2_vl", folder)
    model = load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True, vision=True)
    return reference, ids, model


def vision_service(model, cache_blocks: int = 0) -> Service:
    backend = TorchBackend(model, CpuRunner(), lanes=2, max_model_len=1024)
    core = LaneCore(backend, text_factory(model.tokenizer), (), max_rows=64, cache_bytes=cache_blocks * backend.shape.bytes_per_block)
    inputs = VisionInputs(MediaFetcher(), model.vision_tokens, image=PARAMS, video=PARAMS)
    return Service(core, model.tokenizer, "tiny-vl", "qwen2_vl", 1024, vocab_size=model.config.vocab_size,
                   vision=True, vision_inputs=inputs)


def png(seed: int, size=(90, 60)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_message(data: bytes, text: str = "the hat") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(data)}},
                                         {"type": "text", "text": text}]}]


def reference_tokens(reference, ids, model, image: bytes, text: str, n: int) -> list[int]:
    """transformers' greedy tokens for the same conversation, its pixels from its own image processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(min_pixels=PARAMS.min_pixels, max_pixels=PARAMS.max_pixels)
    out = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    grid = out["image_grid_thw"]
    rendered = model.tokenizer.render_chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}])
    prompt = []
    for token in model.tokenizer.encode(rendered):
        prompt += [token] * (int(grid.prod()) // 4 if token == ids["<|image_pad|>"] else 1)
    sequence = list(prompt)
    for _ in range(n):
        input_ids = torch.tensor([sequence])
        types = torch.zeros_like(input_ids)
        types[0, : len(prompt)] = (input_ids[0, : len(prompt)] == ids["<|image_pad|>"]).long()
        reference.model.rope_deltas = None
        with torch.no_grad():
            logits = reference(input_ids=input_ids, pixel_values=out["pixel_values"], image_grid_thw=grid,
                               mm_token_type_ids=types).logits
        sequence.append(int(logits[0, -1].argmax()))
    return sequence[len(prompt):]


async def test_an_image_by_data_url_is_answered_as_transformers_answers_it(vl):
    reference, ids, model = vl
    image = png(1)
    expected = model.tokenizer.decode(reference_tokens(reference, ids, model, image, "the hat", 6))
    async with serving(vision_service(model)) as url:
        openai = client(url)

        def ask():
            return openai.chat.completions.create(model="tiny-vl", messages=image_message(image), temperature=0,
                                                  max_tokens=6, extra_body={"ignore_eos": True})

        with trio.fail_after(60):
            reply = await trio.to_thread.run_sync(ask)
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens == 6


async def test_the_cache_keys_prompts_by_their_images(vl):
    _, _, model = vl
    first, second = png(2), png(3)
    async with serving(vision_service(model, cache_blocks=64)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(60):
                usage = []
                for image in (first, first, second):
                    body = {"messages": image_message(image), "temperature": 0, "max_tokens": 2}
                    answer = await http.post(CHAT, json=body)
                    assert answer.status_code == 200, answer.text
                    usage.append(answer.json()["usage"])
    prompt = usage[0]["prompt_tokens"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    assert prompt > 40 and cached[0] == 0
    assert cached[1] == (prompt - 1) // 16 * 16  # the same image: every full block restored
    rendered = model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": [{"type": "image"}]}]))
    before_image = rendered.index(model.vision_tokens.image)
    assert cached[2] == before_image // 16 * 16  # another image: only the blocks before its rows


@pytest.mark.parametrize("data, code", [
    (b"not an image at all", "image_unreadable"),
    (png(4)[:200], "image_truncated"),
])
async def test_bad_images_are_refused_with_400_and_the_server_is_unharmed(vl, data, code):
    _, _, model = vl
    async with serving(vision_service(model)) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(60):
                refused = await http.post(CHAT, json={"messages": image_message(data), "max_tokens": 2})
                assert refused.status_code == 400
                assert refused.json()["error"]["code"] == code
                answered = await http.post(CHAT, json={"messages": image_message(png(5)), "max_tokens": 2})
                assert answered.status_code == 200


def mp4(seed: int, frames: int = 8, size=(56, 84)) -> bytes:
    """A short mp4 of changing random frames (4 fps), made with av."""
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = size[1], size[0], "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (size[0], size[1], 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


async def test_a_video_by_data_url_and_completions_images_are_answered_and_counted(vl):
    reference, ids, model = vl
    service = vision_service(model)
    video = mp4(7)
    measured = measure_video(video, PARAMS, service.vision_inputs.sampling)  # its rows, as the server will lay them out
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            with trio.fail_after(60):
                chat = await http.post(CHAT, json={"messages": [{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}}, {"type": "text", "text": "the cat"}]}],
                    "max_tokens": 3, "temperature": 0, "ignore_eos": True})
                plain = await http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": [
                    {"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}}, {"type": "text", "text": "the cat"}]}]})
                image = png(8)
                completion = await http.post("/v1/completions", json={"prompt": "the hat", "images": [data_url(image)],
                                                                        "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    assert measured.grid[0] >= 2 and chat.json()["usage"]["completion_tokens"] == 3
    tokens = plain.json()["tokens"]
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens) and tokens.count(ids["<|video_pad|>"]) == measured.tokens
    assert completion.status_code == 200, completion.text
    image_rows = measure_image(image, PARAMS).tokens
    text = model.tokenizer.encode("the hat")
    assert completion.json()["usage"]["prompt_tokens"] == 2 + image_rows + len(text)  # start, rows, end, then the prompt
