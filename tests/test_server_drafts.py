"""`lanes serve --draft ...` end to end: the flags build the drafter, the answers equal the undrafted
server's, /v1/info and /metrics count what was drafted and accepted, and flags that cannot go together
are refused by name.

Rules: a live server on 127.0.0.1 port 0 built by `build_service` from parsed flags over a tiny checkpoint
built here; the official `openai` client; a bias makes the output repeat so that drafts are found.
"""

import argparse
import re

import httpx
import pytest
import trio

import tiny
from lanes.flags import add_serve_flags
from lanes.serve import NotAvailable, build_service, refuse_unbuilt
from server_helpers import client, serving


def flags(*more: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    return parser.parse_args(list(more))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-drafts")
    tiny.build("llama", folder, max_position_embeddings=512)
    return folder


async def answers(service, bodies: list[dict]) -> tuple[list, str]:
    async with serving(service) as url:
        api = client(url, timeout=30)

        def calls():
            return [api.completions.create(model=service.model_name, **body) for body in bodies]

        with trio.fail_after(60):
            replies = await trio.to_thread.run_sync(calls)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                metrics = (await http.get("/metrics")).text
                info = (await http.get("/v1/info")).json()
    return replies, metrics, info


@pytest.mark.parametrize("method", ["ngram", "suffix", "model"])
async def test_a_drafting_server_answers_as_one_without_drafts_and_counts_its_drafts(folder, method):
    bodies = [dict(prompt=text, max_tokens=24, temperature=0, logprobs=2, extra_body={"logit_bias": {str(20 + i): 100}})
              for i, text in enumerate(["the cat sat", "on the mat", "a hat in the hat"])]
    base = ["--model", str(folder), "--device", "cpu", "--lanes", "4", "--max-model-len", "256"]
    plain, _, _ = await answers(build_service(flags(*base)), bodies)
    more = ["--draft-model", str(folder)] if method == "model" else ["--draft", method]
    # fixed lengths: load control learns from wall-clock pass times, which a test must not depend on
    drafted, metrics, info = await answers(build_service(flags(*base, *more, "--draft-tokens", "6",
                                                                "--draft-lengths", "fixed")), bodies)
    for got, want in zip(drafted, plain, strict=True):
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
        assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.choices[0].logprobs.token_logprobs, abs=1e-5)
    drafts = info["drafts"]
    assert drafts["method"] == method and drafts["most_tokens"] == 6 and drafts["accepted"] > 0 and drafts["pieces"] > 0
    assert drafts["mean_accepted_length"] == pytest.approx(drafts["accepted"] / drafts["pieces"])
    name = f'{{model_name="{folder.name}"}}'
    assert re.search(rf"^lanes_draft_accepted_tokens_total{re.escape(name)} {drafts['accepted']}\.0$", metrics, re.M)
    assert re.search(rf"^lanes_draft_tokens_total{re.escape(name)} {drafts['drafted']}\.0$", metrics, re.M)


async def test_a_cpu_server_drafts_up_to_16_tokens_a_lane_unless_told_otherwise(folder):
    base = ["--model", str(folder), "--device", "cpu", "--lanes", "2", "--max-model-len", "256", "--draft", "ngram"]
    body = [dict(prompt="the cat sat", max_tokens=4, temperature=0)]
    _, _, info = await answers(build_service(flags(*base)), body)
    assert info["drafts"]["most_tokens"] == 16
    _, _, info = await answers(build_service(flags(*base, "--draft-tokens", "3")), body)
    assert info["drafts"]["most_tokens"] == 3


@pytest.mark.parametrize("more, words", [
    (["--draft", "model"], "--draft model needs --draft-model PATH"),
    (["--draft", "ngram", "--draft-model", "x"], "--draft-model drafts with a model; it does not go with --draft ngram"),
    (["--draft", "ngram", "--draft-tokens", "0"], "--draft-tokens must be between 1 and 16"),
])
def test_flags_that_cannot_go_together_are_refused_by_name(more, words):
    with pytest.raises(NotAvailable) as refused:
        refuse_unbuilt(flags(*more))
    assert str(refused.value) == words


def test_a_draft_model_with_another_tokenizer_is_refused_at_start(folder, tmp_path):
    tiny.build("llama", tmp_path / "other", labels=True)  # its vocabulary has more merges
    with pytest.raises(NotAvailable) as refused:
        build_service(flags("--model", str(folder), "--device", "cpu", "--max-model-len", "256",
                            "--draft-model", str(tmp_path / "other")))
    assert str(refused.value) == f"--draft-model {tmp_path / 'other'}: its tokenizer is not the served model's"
