"""Soak: many clients against a live `python -m lanes serve` for a set time, then SIGTERM.

    python bench/soak.py [--seconds 600] [--clients 24] [--slow 3] [--model M] [--stream-writers N]

Clients draw (from a fixed seed) chat and completions requests, streams they leave after a few chunks,
decisions, tokenize calls, malformed bodies, wrong types, oversize bodies and oversize headers; a few slow
clients send half a body and wait for the 408 (bounded in count and time; loopback only). At the end the
server must be idle with nothing held: no busy lane, no queued or open request, every KV block free or
held by the prompt cache; then SIGTERM must end it with exit 0. Prints requests served, answers by kind,
leaks and the server's resident memory over the run.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import trio

CHAT = "/v1/chat/completions"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args, log_path: str) -> tuple[subprocess.Popen, str]:
    """The server, its log going to a file (a pipe nobody drains would fill and stall it)."""
    command = [sys.executable, "-m", "lanes", "serve", "--port", "0", "--lanes", "8", "--max-queue", "32",
               "--max-model-len", "1024", "--decider", "--body-timeout", "5"]
    if args.model:
        command += ["--model", args.model]
    if args.stream_writers:
        command += ["--stream-writers", str(args.stream_writers)]
    log = open(log_path, "w")
    server = subprocess.Popen(command, stderr=log, stdout=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        for line in open(log_path):
            if " serving " in line:
                return server, line.rsplit(" on ", 1)[1].strip()
        time.sleep(0.5)  # polling the log of a process we do not control
    raise SystemExit(f"the server did not start:\n{open(log_path).read()[-2000:]}")


KINDS = [(0.35, "chat"), (0.60, "stream"), (0.70, "completion"), (0.74, "malformed json"), (0.78, "wrong types"),
         (0.81, "oversize body"), (0.84, "oversize headers"), (0.94, "decision"), (1.0, "tokenize")]


def kind_of(roll: float) -> str:
    return next(name for bound, name in KINDS if roll < bound)


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Counter) -> None:
    roll = rng.random()
    words = " ".join(rng.choice(["ships", "river", "the", "harbour", "north", "cargo", "frost", "price"]) for _ in range(rng.randint(3, 60)))
    if roll < 0.35:
        kind, response = "chat", await http.post(CHAT, json={"messages": [{"role": "user", "content": words}],
                                                             "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8])})
    elif roll < 0.60:
        kind, leave = "stream", rng.random() < 0.4
        async with http.stream("POST", CHAT, json={"messages": [{"role": "user", "content": words}], "stream": True,
                                                   "max_tokens": rng.randint(4, 24)}) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if leave and seen >= rng.randint(1, 5):
                    kind = "stream (left early)"
                    break
    elif roll < 0.70:
        kind, response = "completion", await http.post("/v1/completions", json={
            "prompt": words, "max_tokens": rng.randint(1, 8), "logprobs": 2, "echo": rng.random() < 0.5})
    elif roll < 0.74:
        kind, response = "malformed json", await http.post(CHAT, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    elif roll < 0.78:
        kind, response = "wrong types", await http.post(CHAT, json={"messages": "hello", "n": "two"})
    elif roll < 0.81:
        kind, response = "oversize body", await http.post(CHAT, content=b"x" * (5 << 20), headers={"Content-Type": "application/json"})
    elif roll < 0.84:
        kind, response = "oversize headers", await http.post(CHAT, json={"messages": []}, headers={"X-Pad": "y" * 30000})
    elif roll < 0.94:
        kind, response = "decision", await http.post("/v1/decisions", json={
            "model": "default", "input": words, "questions": [
                {"type": "predicate", "instructions": "Is a ship named?"},
                {"type": "score", "instructions": "How cold is it?", "levels": [{"label": "warm"}, {"label": "cold"}]}]})
    else:
        kind, response = "tokenize", await http.post("/v1/tokenize", json={"prompt": words})
    tally[(kind, response.status_code)] += 1


async def client(url: str, seed: int, until: float, tally: Counter) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            state = rng.getstate()
            try:
                await one_request(http, rng, tally)
            except httpx.HTTPError as error:
                # An oversize body is refused (413) while it is still being sent: the client sees the close.
                rng.setstate(state)
                tally[(kind_of(rng.random()), type(error).__name__)] += 1


async def slow_client(url: str, until: float, tally: Counter) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    while time.monotonic() < until:
        with trio.move_on_after(30):
            stream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Length: 500\r\n\r\n{")
            reply = await stream.receive_some(4096)
            await stream.aclose()
            tally[("slow body", reply.split(b" ", 2)[1].decode() if reply else "closed")] += 1


async def soak(args, url: str, pid: int) -> tuple[Counter, list[tuple[float, float]], dict]:
    tally: Counter = Counter()
    memory: list[tuple[float, float]] = []
    start = time.monotonic()
    until = start + args.seconds

    async def sample_memory():
        while time.monotonic() < until:
            memory.append((time.monotonic() - start, rss_mb(pid)))
            await trio.sleep(15)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_memory)
        for i in range(args.clients):
            nursery.start_soon(client, url, 1000 + i, until, tally)
        for _ in range(args.slow):
            nursery.start_soon(slow_client, url, until, tally)
    memory.append((time.monotonic() - start, rss_mb(pid)))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(600):  # the last requests drain
            info = (await http.get("/v1/info")).json()
            if not info["lanes_busy"] and not info["admission"]["queued"] and not info["admission"]["open_requests"]:
                break
            await trio.sleep(0.1)
        metrics = (await http.get("/metrics")).text
    cache = info["prompt_cache"] or {"entries": 0}
    leaks = {
        "busy lanes": info["lanes_busy"],
        "queued requests": info["admission"]["queued"],
        "open requests": info["admission"]["open_requests"],
        "KV blocks held outside the cache": info["kv_blocks"]["total"] - info["kv_blocks"]["free"] - cache["entries"],
        "500 answers": sum(n for (kind, status), n in tally.items() if status == 500),
    }
    served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("lanes_requests_total"))
    leaks["requests the server counted"] = int(served)
    return tally, memory, leaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--slow", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--stream-writers", type=int, default=0, help="the server's --stream-writers")
    args = parser.parse_args()
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"lanes-soak-{os.getpid()}.log")
    server, url = start_server(args, log_path)
    try:
        tally, memory, leaks = trio.run(soak, args, url, server.pid)
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=90)
    finally:
        server.kill()
    print(f"\nsoak: {args.seconds:.0f} s, {args.clients} clients and {args.slow} slow ones against {url}")
    print(f"{'answer':<32} {'status':>8} {'count':>7}")
    for (kind, status), count in sorted(tally.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"{kind:<32} {status!s:>8} {count:>7}")
    print(f"\n{'requests answered':<32} {sum(tally.values()):>16}")
    for name, value in leaks.items():
        print(f"{name:<32} {value:>16}")
    first = next((m for t, m in memory if t >= 60), memory[0][1])
    print(f"{'resident memory MB (1 min, end)':<32} {first:>8.0f} {memory[-1][1]:>7.0f}")
    print(f"{'exit code after SIGTERM':<32} {code:>16}")
    print(f"{'server log lines':<32} {sum(1 for _ in open(log_path)):>16}")
    bad = code != 0 or any(leaks[k] for k in leaks if k != "requests the server counted")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
