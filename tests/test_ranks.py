"""Tensor-parallel ranks on the CPU with gloo: `lanes serve --tp 2` as real processes, explicit ranks and the
launcher form, against the single-rank server on the same tiny model; and every way the ranks end.

Rules: real processes on 127.0.0.1 port 0; the reference is the single-rank server in this process (its
books checked when it stops, as every server checks its own at a clean stop: exit 0 means they balanced);
greedy tokens equal, logprobs within 1e-4 (fp32); every exit awaited under a bound (item 4's 30 s), a
death while idle found by the heartbeats; no sleeps: a process's end is its pidfd turning readable or its
exit being reaped.
"""

import json
import re
import signal

import httpx
import pytest
import trio

import tiny
from lanes.core.blocks import IntegrityError
from lanes.followers import HEARTBEAT
from lanes.gpu.device import choose
from lanes.gpu.ranks import PASS_SECONDS
from lanes.loader import load_model
from lanes.runtime import Runtime
from rank_helpers import children_of, gone, start, start_two_ranks
from server_helpers import serving, torch_service

PROMPTS = ["the cat sat on the mat", "a hat", "on the mat in the hat the cat sat and sat and sat", "0123456789"]
STATE = "the cat sat on the mat in the hat"
QUESTIONS = [{"type": "predicate", "instructions": "Is the cat on the mat?", "name": "on_mat"},
             {"type": "choice", "instructions": "Where is the cat?", "choices": [{"value": "mat"}, {"value": "hat"}]}]
BOUND = 30  # item 4: every end within 30 s


def completion(prompt: str, max_tokens: int = 24, **more) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **more}


def decide(model: str) -> dict:
    return {"model": model, "input": STATE, "questions": QUESTIONS}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tp")
    tiny.build("qwen2", folder, labels=True, max_position_embeddings=512)  # qwen2: the q/k/v biases are sharded too
    return folder


@pytest.fixture(scope="module")
def reference(folder):
    """The single-rank server's answers to every request the tests make (greedy, with logprobs)."""

    async def answers():
        model = load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True)
        async with serving(torch_service(model, lanes=4, max_model_len=512, decides=True)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                found = {p: (await http.post("/v1/completions", json=completion(p, logprobs=3))).json() for p in PROMPTS}
                decision = (await http.post("/v1/decisions", json=decide("tiny"))).json()
        return found, decision

    return trio.run(answers)


def assert_same(reply: dict, expected: dict) -> None:
    """Token for token, and every logprob (chosen and top alternatives) within 1e-4."""
    assert "choices" in reply and "choices" in expected, (reply, expected)
    got, want = reply["choices"][0], expected["choices"][0]
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    for top, top_want in zip(got["logprobs"]["top_logprobs"], want["logprobs"]["top_logprobs"], strict=True):
        assert top.keys() == top_want.keys() and list(top.values()) == pytest.approx(list(top_want.values()), abs=1e-4)


async def open_stream(http: httpx.AsyncClient, prompt: str, max_tokens: int):
    """A streamed completion whose first token has arrived: (response, its line iterator)."""
    request = http.build_request("POST", "/v1/completions", json=completion(prompt, max_tokens, stream=True))
    response = await http.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    async for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"]:
            return response, lines
    raise AssertionError("the stream ended before its first token")


async def rest_of(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in [line async for line in lines] if line.startswith("data: {")]


async def test_two_explicit_ranks_equal_the_single_rank_server_with_cache_and_decisions(folder, reference):
    expected, decision = reference
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, folder, "--lanes", "4", "--decider")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                replies = {}

                async def ask(prompt):
                    replies[prompt] = (await http.post("/v1/completions", json=completion(prompt, logprobs=3))).json()

                async with trio.open_nursery() as clients:  # one batch: prompt passes and decode rows together
                    for prompt in PROMPTS:
                        clients.start_soon(ask, prompt)
                again = (await http.post("/v1/completions", json=completion(PROMPTS[2], logprobs=3))).json()
                info = (await http.get("/v1/info")).json()
                decided = (await http.post("/v1/decisions", json=decide(info["model"]))).json()
                metrics = (await http.get("/metrics")).text
            rank0.signal(signal.SIGTERM)
            with trio.fail_after(BOUND):
                assert await rank0.exit_code() == 0, rank0.text
                assert await rank1.exit_code() == 0, rank1.text
    for prompt in PROMPTS:
        assert_same(replies[prompt], expected[prompt])
    assert_same(again, expected[PROMPTS[2]])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # two whole blocks of the prompt's 49
    assert "answers" in decided and "answers" in decision, (decided, decision)
    for got, want in zip(decided["answers"], decision["answers"], strict=True):
        assert [p["probability"] for p in got.get("probabilities", [got])] == pytest.approx(
            [p["probability"] for p in want.get("probabilities", [want])], abs=1e-4)
    assert info["tp"] == 2 and info["followers"]["world"] == 2 and info["followers"]["state"] == "up"
    assert info["followers"]["plans"] > 0 and info["lanes_busy"] == 0
    assert f'lanes_world_size{{model_name="{info["model"]}"}} 2.0' in metrics
    assert f'lanes_followers_up{{model_name="{info["model"]}"}} 1.0' in metrics
    assert "stopped by rank 0 after" in rank1.text and "Traceback" not in rank0.text + rank1.text


async def test_the_launcher_form_equals_a_single_rank_frees_a_cancelled_lane_and_ends_on_sigterm(folder, reference):
    expected, _ = reference
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            launcher = await start(nursery, folder, "--tp", "2", "--lanes", "1", name="launcher")
            url = await launcher.until_serving()
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                first = (await http.post("/v1/completions", json=completion(PROMPTS[0], logprobs=3))).json()
                response, _ = await open_stream(http, PROMPTS[1], 400)
                await response.aclose()  # the client leaves: its one lane must come free on every rank
                after = (await http.post("/v1/completions", json=completion(PROMPTS[3], logprobs=3))).json()
                response, lines = await open_stream(http, PROMPTS[1], 200)
                launcher.signal(signal.SIGTERM)  # mid-stream: the stream finishes within the grace, then all stop
                chunks = await rest_of(lines)
            with trio.fail_after(BOUND):
                assert await launcher.exit_code() == 0, launcher.text
    assert_same(first, expected[PROMPTS[0]])
    assert_same(after, expected[PROMPTS[3]])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert "rank 1 exited with status 0" in launcher.text and "INFO lanes: stopped" in launcher.text


async def test_killing_rank_1_mid_stream_fails_the_client_and_rank_0_exits_non_zero(folder):
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, folder)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                _, lines = await open_stream(http, PROMPTS[0], 400)
                rank1.signal(signal.SIGKILL)
                with trio.fail_after(BOUND):
                    chunks = await rest_of(lines)
                    assert await rank0.exit_code() == 1, rank0.text
    assert chunks[-1] == {"error": {"message": "the model failed and the server is stopping", "type": "server_error",
                                    "param": None, "code": "model_failed"}}
    last = rank0.lines[-1]
    # The loss shows in the plan's broadcast or in the pass's collective, whichever comes first.
    assert re.fullmatch(r"lanes: error: the model pass failed: PeerLost: rank 0 lost a (follower|peer in a collective): .+", last), last
    assert "Traceback" not in rank0.text


async def test_killing_rank_0_mid_stream_ends_the_follower_non_zero(folder):
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, folder)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                _, lines = await open_stream(http, PROMPTS[0], 400)
                rank0.signal(signal.SIGKILL)
                with trio.fail_after(BOUND):
                    with pytest.raises(httpx.RemoteProtocolError):
                        await rest_of(lines)  # the connection closes mid-body
                    assert await rank1.exit_code() == 1, rank1.text
    assert any("rank 1 lost a peer in a collective" in line or "rank 0 is gone" in line for line in rank1.lines), rank1.text
    assert "Traceback" not in rank1.text


async def test_killing_rank_1_while_idle_ends_rank_0_non_zero_through_its_heartbeat(folder):
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, folder)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                assert (await http.get("/v1/info")).json()["followers"]["state"] == "up"
            rank1.signal(signal.SIGKILL)  # no request in flight: only a heartbeat can find the loss
            killed = trio.current_time()
            with trio.fail_after(BOUND):
                assert await rank0.exit_code() == 1, rank0.text
            took = trio.current_time() - killed
    # A heartbeat goes out within 2 * HEARTBEAT of quiet; its send to a dead process fails at once.
    assert took < 2 * HEARTBEAT + PASS_SECONDS, (took, rank0.text)  # a dead host: the send times out
    assert any(re.fullmatch(r".* ERROR lanes: rank 0 lost a follower: .+", line) for line in rank0.lines), rank0.text
    assert re.fullmatch(r"lanes: error: rank 0 lost a follower: .+", rank0.lines[-1]), rank0.lines[-1]
    assert "Traceback" not in rank0.text


async def test_killing_rank_0_while_idle_ends_the_follower_non_zero(folder):
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            rank0, rank1, _ = await start_two_ranks(nursery, folder)
            rank0.signal(signal.SIGKILL)
            killed = trio.current_time()
            with trio.fail_after(BOUND):
                assert await rank1.exit_code() == 1, rank1.text
            took = trio.current_time() - killed
    # The follower waits in its receive; the closed connection (or the group's short timeout) ends it.
    assert took < PASS_SECONDS + HEARTBEAT, (took, rank1.text)
    assert any(re.fullmatch(r".* ERROR lanes\.followers: rank 0 is gone: .+ \(after 0 passes\)", line)
               for line in rank1.lines), rank1.text
    assert "Traceback" not in rank1.text


async def test_no_rank_outlives_a_killed_launcher(folder):
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            launcher = await start(nursery, folder, "--tp", "2", name="launcher")
            await launcher.until_serving()
            followers = children_of(launcher.process.pid)
            assert len(followers) == 1
            launcher.signal(signal.SIGKILL)
            with trio.fail_after(BOUND):
                await launcher.exit_code()
                await gone(followers[0])


async def test_a_server_that_stops_with_a_block_still_held_logs_its_books_and_fails_the_stop(folder, caplog):
    model = load_model(folder, choose("cpu", "fp32"), kv_blocks=64, quiet=True)
    service = torch_service(model, lanes=2, max_model_len=512)
    runtime = Runtime(service, host="127.0.0.1", port=0, grace=0)
    with trio.fail_after(60), pytest.RaisesGroup(IntegrityError):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.run)
            service.core.pool.allocate(("leak",), 1)  # a block nobody gives back: rank 0 and a single rank alike
            runtime.request_stop()
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert logged == [f"the lane core's books do not balance at the stop: blocks still held after the stop: "
                      f"{service.core.pool.statistics()}"]


async def test_two_ranks_of_an_moe_family_equal_the_single_rank_server(tmp_path):
    """GLM-4.5's shape (a dense first layer, grouped sigmoid routing, a shared expert, partial rotary) over
    gloo: every expert split over both ranks; prompt passes and decode rows in shared passes."""
    tiny.build("glm4_moe", tmp_path, num_hidden_layers=3, n_group=2, topk_group=1, attention_bias=True)
    model = load_model(tmp_path, choose("cpu", "fp32"), kv_blocks=200, quiet=True)
    with trio.fail_after(120):
        async with serving(torch_service(model, lanes=4, max_model_len=512)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                expected = {p: (await http.post("/v1/completions", json=completion(p, logprobs=3))).json() for p in PROMPTS}
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, tmp_path, "--lanes", "4")
            replies = {}
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:

                async def ask(prompt):
                    replies[prompt] = (await http.post("/v1/completions", json=completion(prompt, logprobs=3))).json()

                async with trio.open_nursery() as clients:
                    for prompt in PROMPTS:
                        clients.start_soon(ask, prompt)
            rank0.signal(signal.SIGTERM)
            with trio.fail_after(BOUND):
                assert await rank0.exit_code() == 0, rank0.text
                assert await rank1.exit_code() == 0, rank1.text
    for prompt in PROMPTS:
        assert_same(replies[prompt], expected[prompt])
    assert "Traceback" not in rank0.text + rank1.text


def test_rank_flags_are_checked_before_anything_loads(folder):
    import subprocess
    import sys

    refused = subprocess.run([sys.executable, "-m", "lanes", "serve", "--model", str(folder), "--tp", "2", "--rank", "2",
                              "--master", "127.0.0.1", "--master-port", "1"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip() == "lanes: error: --rank 2 is outside 0..1"


async def test_two_ranks_drafting_equal_one_rank_without_drafts(folder):
    """The plan carries the drafts, so rank 1 runs the same drafted rows; a bias makes the output repeat, so
    n-grams draft (most of them right). Constrained streams too: rank 0 alone computes masks."""
    bodies = [completion(p, 30, logprobs=2, logit_bias={str(11 + i): 100}) for i, p in enumerate(PROMPTS)]
    bodies += [completion(p, 16, logprobs=2) for p in PROMPTS]
    bodies += [{"prompt": p, "max_tokens": 20, "temperature": 0, "logprobs": 2, **held}
               for p, held in zip(PROMPTS, [{"guided_regex": "[a-z ]{2,30}"}, {"guided_choice": ["mat", "hat"]},
                                            {"response_format": {"type": "json_object"}},
                                            {"structured_outputs": {"regex": "(sat ){1,9}"}}])]
    model = load_model(folder, choose("cpu", "fp32"), kv_blocks=200, quiet=True)
    with trio.fail_after(120):
        async with serving(torch_service(model, lanes=4, max_model_len=512)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                expected = [(await http.post("/v1/completions", json=body)).json() for body in bodies]
        async with trio.open_nursery() as nursery:
            rank0, rank1, url = await start_two_ranks(nursery, folder, "--lanes", "4", "--draft", "ngram",
                                                       "--draft-lengths", "fixed")
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                got = [(await http.post("/v1/completions", json=body)).json() for body in bodies]
                drafts = (await http.get("/v1/info")).json()["drafts"]
            rank0.signal(signal.SIGTERM)
            with trio.fail_after(BOUND):
                assert await rank0.exit_code() == 0, rank0.text
                assert await rank1.exit_code() == 0, rank1.text
    for reply, want in zip(got, expected, strict=True):
        assert_same(reply, want)
    assert drafts["method"] == "ngram" and drafts["pieces"] > 0 and drafts["accepted"] > 0, drafts
