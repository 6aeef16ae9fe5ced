"""Decisions at their limits, over HTTP: a full decision queue answers 429 with Retry-After, a decision past
its deadline its timeout, a decision whose client leaves is cancelled with its lanes freed in one pass, and
one longer than the KV pool holds is refused at once.

Rules: live servers on 127.0.0.1 port 0 on a fake backend (label reads that depend on the whole context)
with a tiny tokenizer whose decision labels are single tokens; busy lanes are made by holding a pass inside
the backend, never by sleeping; every test under `trio.fail_after`; the lane core's integrity and a
balanced block pool are checked when each server stops.
"""

from functools import partial

import httpx
import trio

from golden_server import HELLO, fake_service
from lanes.http.decision_prompts import Option, Question, render
from server_helpers import counted, serving, until

CHAT = "/v1/chat/completions"
QUESTIONS = [{"type": "predicate", "instructions": "Is it red?"}, {"type": "predicate", "instructions": "Is it blue?"}]
DECISION = {"model": "tiny", "input": "a ball", "questions": QUESTIONS[:1]}
SYSTEMONE = {"state": "a ball", "questions": {"red": {"type": "noul", "instructions": "Is it red?"}}}


def decider(folder, **options):
    return fake_service(folder, decides=True, labels=True, max_model_len=256, **options)


async def post_into(replies: dict, http: httpx.AsyncClient, name: str, path: str, body: dict) -> None:
    replies[name] = await http.post(path, json=body)


async def test_a_full_decision_queue_answers_429_with_retry_after_and_the_queued_decision_is_answered_after(tmp_path):
    service, backend = decider(tmp_path, lanes=1, max_decisions=1)
    replies: dict[str, httpx.Response] = {}
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post_into, replies, http, "stream", CHAT, {"messages": HELLO, "max_tokens": 2})
                await entered.wait()  # the stream holds the only lane: decisions wait in their queue
                nursery.start_soon(post_into, replies, http, "queued", "/v1/decisions", DECISION)
                await until(lambda: len(service.core.decider.queue) == 1)
                full = await http.post("/v1/decisions", json=DECISION)
                full_systemone = await http.post("/v1/systemone", json=SYSTEMONE)
                release.set()
    for refused in (full, full_systemone):
        assert (refused.status_code, refused.headers["Retry-After"]) == (429, "1")
        assert refused.json()["error"] == {"message": "the server is busy: every lane is taken and the queue is full; retry shortly",
                                           "type": "rate_limit_error", "param": None, "code": "queue_full"}
    assert replies["stream"].status_code == 200 and replies["queued"].status_code == 200
    assert [a["type"] for a in replies["queued"].json()["answers"]] == ["predicate"]
    assert service.core.decider.counts == dict(asked=1, answered=1, failed=0)


async def test_a_decision_past_its_deadline_answers_its_timeout(tmp_path):
    service, backend = decider(tmp_path, lanes=1, decision_timeout=0.3)
    replies: dict[str, httpx.Response] = {}
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post_into, replies, http, "stream", CHAT, {"messages": HELLO, "max_tokens": 2})
                await entered.wait()  # held past the decision's 0.3 s: it never gets a lane
                late = await http.post("/v1/decisions", json=DECISION)
                release.set()
    assert late.status_code == 504
    assert late.json()["error"] == {"message": "the request did not finish before its deadline", "type": "timeout_error",
                                    "param": None, "code": "deadline_exceeded"}
    assert counted(service, "decisions", 504) == 1 and replies["stream"].status_code == 200
    assert service.core.decider.counts == dict(asked=1, answered=0, failed=1)


async def test_a_decision_whose_client_leaves_is_cancelled_and_frees_its_lanes_within_one_pass(tmp_path):
    service, backend = decider(tmp_path, lanes=2, max_rows=8)  # 8 rows a pass: each branch's prompt takes several
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as client:
                client.start_soon(partial(http.post, "/v1/decisions", json={**DECISION, "questions": QUESTIONS}))
                await entered.wait()
                while service.core.statistics().lanes_busy < 2:  # pass by held pass until both branches hold lanes
                    entered, release_this = backend.hold()
                    release.set()
                    release = release_this
                    await entered.wait()
                client.cancel_scope.cancel()  # the client goes away mid-prefill
            await until(lambda: counted(service, "decisions", 499) == 1)
            at_leave = service.core.statistics()
            release.set()
            await until(lambda: service.core.statistics().lanes_busy == 0)
            info = (await http.get("/v1/info")).json()
    stats = service.core.statistics()
    assert at_leave.lanes_busy == 2 and stats.passes == at_leave.passes + 1  # freed at the held pass's boundary
    assert service.core.decider.counts == dict(asked=1, answered=0, failed=1)
    assert (info["lanes_busy"], info["kv_blocks"]["free"], info["admission"]["open_requests"]) == (0, 64, 0)


async def test_a_decision_longer_than_the_kv_pool_holds_is_refused_at_once_as_chat_would_be(tmp_path):
    service, _ = decider(tmp_path, blocks=4, decision_timeout=600)  # 64 tokens of KV under a 256-token context
    question = Question("predicate", "Is it red?", (Option("true"), Option("false")))
    tokens = len(render(service.tokenizer, None, "a ball", question))
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(10):  # before the fix it waited out its deadline
                refused = await http.post("/v1/decisions", json=DECISION)
                unprocessable = await http.post("/v1/systemone", json=SYSTEMONE)
    message = f"this request needs {tokens} tokens of context but the model's limit is 64; shorten the input or the questions"
    assert (refused.status_code, unprocessable.status_code) == (400, 422)
    assert refused.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "input",
                                       "code": "context_length_exceeded"}
    assert unprocessable.json()["error"] == {**refused.json()["error"], "param": "state"}
    assert service.core.decider.counts["asked"] == 0
