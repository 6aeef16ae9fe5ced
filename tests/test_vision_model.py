"""Qwen2-VL and Qwen2.5-VL language models with images and videos in the prompt, against transformers.

Rules: tiny random models built in the test (tests/tiny_vl.py); fp32 on the CPU; random pixel values from a
fixed seed; the reference is transformers' forward over the whole sequence (prompt and generated tokens)
with its own M-RoPE index; logits within 1e-4 (max abs), greedy tokens identical. Prompts are prefilled in
chunks that cut through images, then decoded; through the lane core, two streams at once equal their solo
runs, and `check_integrity()` holds after.
"""

import hashlib

import pytest
import torch
import trio

import tiny_vl
from engine_helpers import collect
from lanes.core.lane_core import LaneCore
from lanes.core.media import PromptMedia
from lanes.core.passes import Piece
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request, TokenEvent
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.backend.vision_lanes import VisionLanes
from lanes.core.blocks import BlockPool, BlockTable
from lanes.gpu.device import CpuRunner, choose
from lanes.loader import load_model

PATCH_DIM = 3 * 2 * 14 * 14
CASES = {
    "one-image": [("image", (1, 4, 6))],
    "two-images": [("image", (1, 4, 6)), ("image", (1, 6, 4))],
    "one-video": [("video", (3, 4, 4))],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (transformers model, placeholder ids, our model loaded with its tower)."""
    out = {}
    for family in ("qwen2_vl", "qwen2_5_vl"):
        folder = tmp_path_factory.mktemp(family)
        model, ids = tiny_vl.build(family, folder)
        ours = load_model(folder, choose("cpu", "fp32"), kv_blocks=96, quiet=True, vision=True)
        out[family] = (model, ids, ours)
    return out


def layout(ids, visuals, family, seed=3):
    """Prompt ids with text around each visual, and its PromptMedia (random pixels)."""
    g = torch.Generator().manual_seed(seed)
    prompt, media = torch.randint(0, 260, (5,), generator=g).tolist(), []
    for kind, grid in visuals:
        rows = grid[0] * (grid[1] // 2) * (grid[2] // 2)
        pixels = torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=g)
        prompt.append(ids["<|vision_start|>"])
        pad = ids["<|image_pad|>" if kind == "image" else "<|video_pad|>"]
        # Qwen2.5-VL spaces a video's temporal patches by tokens_per_second (2) times the seconds a patch spans (1).
        interval = 2.0 if kind == "video" and family == "qwen2_5_vl" else 1.0
        media.append(PromptMedia(kind, len(prompt), rows, grid, pixels, hashlib.sha256(pixels.numpy().tobytes()).digest(),
                                 interval=interval))
        prompt += [pad] * rows + [ids["<|vision_end|>"]] + torch.randint(0, 260, (3,), generator=g).tolist()
    return prompt, media


def reference_logits(model, ids, sequence, media, family):
    """transformers' logits [len(sequence), V] for the whole sequence, images and videos in it."""
    images = [m for m in media if m.kind == "image"]
    videos = [m for m in media if m.kind == "video"]
    input_ids = torch.tensor([sequence])
    types = torch.zeros_like(input_ids)  # by the media's rows: a generated token may be a placeholder id too
    for m in media:
        types[0, m.start : m.end] = 1 if m.kind == "image" else 2
    kwargs = dict(mm_token_type_ids=types)
    if images:
        kwargs.update(pixel_values=torch.cat([m.pixels for m in images]), image_grid_thw=torch.tensor([m.grid for m in images]))
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([m.pixels for m in videos]), video_grid_thw=torch.tensor([m.grid for m in videos]))
        if family == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor([1.0] * len(videos))
    with torch.no_grad():
        model.model.rope_deltas = None
        return model(input_ids=input_ids, **kwargs).logits[0]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prompts_with_images_and_videos_then_8_decode_steps_equal_transformers(built, family, case):
    model, ids, ours = built[family]
    prompt, media = layout(ids, CASES[case], family)
    decoder, tower = ours.decoder, ours.vision
    vision = VisionLanes(tower, 2, torch.device("cpu"))
    vision.bind(0, len(prompt), media)
    pool, table = BlockPool(decoder.kv.blocks), BlockTable(("lane", 0))
    table.reserve(pool, len(prompt) + 8)
    rows, at = [], 0
    while at < len(prompt):  # chunks of 7 rows: every image is cut between two passes
        piece = Piece(0, tuple(prompt[at : at + 7]), at, tuple(table.blocks), "all")
        rows.append(decoder.forward([piece], vision.pass_media([piece])))
        at = piece.end
    sequence, logits = list(prompt), [torch.cat(rows)]
    for _ in range(8):
        token = int(logits[-1][-1].argmax())
        piece = Piece(0, (token,), len(sequence), tuple(table.blocks))
        sequence.append(token)
        logits.append(decoder.forward([piece], vision.pass_media([piece])))
    mine = torch.cat(logits)  # [len(sequence), V]: each row predicts the next token
    theirs = reference_logits(model, ids, sequence, media, family)
    assert mine.shape == theirs.shape
    assert (mine - theirs).abs().max().item() < 1e-4
    assert mine[len(prompt) - 1 :].argmax(-1).tolist() == theirs[len(prompt) - 1 :].argmax(-1).tolist()
    table.clear(pool)
    pool.check_integrity()


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
async def test_two_streams_with_media_at_once_equal_their_solo_runs_and_transformers(built, family):
    model, ids, ours = built[family]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    requests = []
    for case, seed in (("two-images", 5), ("one-video", 6)):
        prompt, media = layout(ids, CASES[case], family, seed=seed)
        requests.append(Request(tuple(prompt), greedy, media=tuple(media)))

    async def run(batch):
        backend = TorchBackend(ours, CpuRunner(), lanes=2, max_model_len=256)
        core = LaneCore(backend, text_factory(ours.tokenizer), [], max_rows=9)  # chunks cut through the images
        async with trio.open_nursery() as nursery:
            await nursery.start(core.run)
            outcomes = [None] * len(batch)

            async def one(i):
                outcomes[i] = await collect(await core.submit(batch[i]))

            async with trio.open_nursery() as clients:
                for i in range(len(batch)):
                    clients.start_soon(one, i)
            await core.shutdown(0)
        core.check_integrity()
        return outcomes

    with trio.fail_after(120):
        together = await run(requests)
        alone = [(await run([r]))[0] for r in requests]
    for request, both, solo in zip(requests, together, alone):
        assert both.tokens == solo.tokens and len(both.tokens) == 8
        theirs = reference_logits(model, ids, list(request.prompt) + both.tokens, request.media, family)
        expected = theirs[len(request.prompt) - 1 : -1]
        assert both.tokens == expected.argmax(-1).tolist()
        reference = torch.log_softmax(expected, -1).gather(1, torch.tensor(both.tokens)[:, None]).squeeze(1)
        logprobs = [e.logprob for e in both.events if isinstance(e, TokenEvent)]
        assert max(abs(a - b) for a, b in zip(logprobs, reference.tolist())) < 1e-4
