"""The golden test: every bad request in tests/golden_server.py against a live server, each answer diffed
with its frozen copy in tests/golden/errors.json; the server answers /health after each; no 500 anywhere.

Rules: live servers on 127.0.0.1 port 0 (a fake backend and a tiny tokenizer: the refusals are the HTTP
layer's); states such as a full queue or a shutdown are made by holding a pass, never by sleeping.
"""

import json

import trio

from golden_server import CASES, GOLDEN, answers


async def test_every_refusal_matches_its_frozen_answer(tmp_path):
    frozen = json.loads(GOLDEN.read_text())
    assert set(frozen) == set(CASES)
    with trio.fail_after(120):
        live = await answers(tmp_path)
    for name in CASES:
        assert live[name] == frozen[name], name
    assert all(400 <= answer["status"] < 500 or answer["status"] == 503 for answer in live.values())
    assert frozen["image-without-vision"]["body"]["error"]["message"] == "image and video inputs need a server started with --vision"
    assert frozen["queue-full"]["status"] == 429 and frozen["queue-full"]["retry_after"] == "1"
    assert frozen["decisions-without-decider"]["status"] == 404
    assert frozen["shutting-down"]["status"] == 503
    context = [frozen[name]["body"]["error"]["code"] for name in ("prompt-past-the-context", "decision-past-the-context")]
    assert context == ["context_length_exceeded"] * 2 and frozen["systemone-past-the-context"]["status"] == 422
    media = {name: frozen[name]["body"]["error"]["code"] for name in ("video-trun-bomb", "video-without-a-codec",
             "too-many-media-parts", "images-past-the-context", "image-over-the-decode-budget")}
    assert media == {"video-trun-bomb": "video_malformed", "video-without-a-codec": "video_codec",
                     "too-many-media-parts": "too_many_media_parts", "images-past-the-context": "context_length_exceeded",
                     "image-over-the-decode-budget": "media_over_budget"}
