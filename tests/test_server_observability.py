"""What the server says about itself: /v1/info's fields and /metrics' gauges in a known busy state, and the
one log line each request gets.

Rules: live servers on 127.0.0.1 port 0 on a fake backend with a tiny tokenizer; the busy state is made by
holding a pass inside the backend (never by sleeping); every test under `trio.fail_after`; the lane core's
integrity and a balanced block pool are checked when each server stops.
"""

import logging
import re
from functools import partial

import httpx
import trio

from golden_server import HELLO, MAX_BODY, fake_service
from server_helpers import serving, until

CHAT = "/v1/chat/completions"
BODY = {"messages": HELLO, "max_tokens": 3, "ignore_eos": True}


def gauges(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line and not line.startswith("#"))}


async def test_info_and_metrics_show_a_busy_lane_and_a_queued_request_then_idle(tmp_path):
    service, backend = fake_service(tmp_path, lanes=1, max_queue=2)
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            entered, release = backend.hold()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(http.post, CHAT, json=BODY))
                await entered.wait()  # the first request holds the only lane, inside a held pass
                nursery.start_soon(partial(http.post, CHAT, json=BODY))
                await until(lambda: service.core.statistics().queued == 1)
                busy = (await http.get("/v1/info")).json()
                busy_metrics = gauges((await http.get("/metrics")).text)
                release.set()
            await until(lambda: service.core.statistics().lanes_busy == 0)  # both answered: the last lane frees
            idle = (await http.get("/v1/info")).json()
            idle_metrics = gauges((await http.get("/metrics")).text)
    facts = {"model": "tiny", "family": "fake", "lanes": 1, "max_rows": 256, "tp": 1, "vision": False, "decides": False}
    limits = {"max_queue": 2, "max_model_len": 64, "request_timeout": 600.0, "max_body_bytes": MAX_BODY,
              "max_header_bytes": 16 << 10, "max_open_requests": 1024, "send_timeout": 30.0,
              "stream_writers": 0}
    assert {key: busy[key] for key in facts} == facts and {key: idle[key] for key in facts} == facts
    assert busy["lanes_busy"] == 1 and busy["admission"] == {**limits, "queued": 1, "open_requests": 2}
    assert idle["lanes_busy"] == 0 and idle["admission"] == {**limits, "queued": 0, "open_requests": 0}
    assert (busy["prompt_cache"], busy["tool_system"], busy["followers"], busy["kv_blocks"]["total"]) == (None, False, None, 64)
    assert idle["kv_blocks"] == {"total": 64, "free": 64}
    shown = [f'{name}{{model_name="tiny"}}' for name in ("lanes_lanes", "lanes_lanes_busy", "lanes_queue_length",
                                                          "lanes_kv_blocks_total", "lanes_world_size")]
    assert [busy_metrics[name] for name in shown] == [1.0, 1.0, 1.0, 64.0, 1.0]
    assert [idle_metrics[name] for name in shown] == [1.0, 0.0, 0.0, 64.0, 1.0]
    assert idle_metrics['lanes_requests_total{endpoint="chat",model_name="tiny",status="200"}'] == 2.0


LINE = re.compile(r"(?P<id>[0-9a-f]{24}) (?P<endpoint>\w+) status=(?P<status>\d+) prompt=(?P<prompt>\d+) "
                  r"completion=(?P<completion>\d+) ttft=(?P<ttft>-|\d+\.\d{3}s) total=(?P<total>\d+\.\d{3})s")


async def test_each_request_gets_one_log_line_with_its_id_status_tokens_and_times(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="lanes.http")
    service, _ = fake_service(tmp_path)
    prompt = len(service.tokenizer.encode_prompt(service.tokenizer.render_chat(HELLO)))
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            answered = (await http.post(CHAT, json=BODY)).json()
            refused = await http.post(CHAT, json={"messages": HELLO, "temperature": "hot"})
    assert refused.status_code == 400
    lines = [LINE.fullmatch(r.getMessage()) for r in caplog.records if r.name == "lanes.http"]
    assert all(lines) and len(lines) == 2, [r.getMessage() for r in caplog.records if r.name == "lanes.http"]
    ok, bad = (line.groupdict() for line in lines)
    assert f"chatcmpl-{ok['id']}" == answered["id"]
    assert (ok["endpoint"], ok["status"], ok["prompt"], ok["completion"]) == ("chat", "200", str(prompt), "3")
    assert ok["ttft"] != "-" and float(ok["ttft"][:-1]) <= float(ok["total"])
    assert (bad["endpoint"], bad["status"], bad["prompt"], bad["completion"], bad["ttft"]) == ("chat", "400", "0", "0", "-")
    assert bad["id"] != ok["id"]


def test_the_inter_token_histogram_fed_at_once_reads_as_prometheus_clients_own_fed_a_value_at_a_time():
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from lanes.http.metrics import LATENCY_BUCKETS, Buckets

    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("lanes_inter_token_seconds", "Time between a stream's tokens.", ["model_name"],
                          buckets=LATENCY_BUCKETS, registry=theirs).labels("tiny")
    buckets = Buckets("lanes_inter_token_seconds", "Time between a stream's tokens.", LATENCY_BUCKETS, "tiny")
    ours.register(buckets)
    chooser = random.Random(3)
    for _ in range(20):  # requests, each its gaps at once: bounds themselves, zeros, past the last bound
        gaps = [chooser.choice([0.0, 0.005, 0.01, 0.25, 60.0, 61.0, chooser.random()]) for _ in range(50)]
        for gap in gaps:
            reference.observe(gap)
        buckets.observe_all(gaps)
    expected = [line for line in generate_latest(theirs).decode().splitlines() if "_created" not in line]
    got = generate_latest(ours).decode().splitlines()
    sums = [float(line.rsplit(" ", 1)[1]) for line in (expected, got) for line in line if "_sum" in line]
    assert [line for line in got if "_sum" not in line] == [line for line in expected if "_sum" not in line]
    assert abs(sums[0] - sums[1]) < 1e-9
