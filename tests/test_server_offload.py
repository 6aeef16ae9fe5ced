"""A huge prompt is rendered and tokenized off the event loop: other streams keep getting events meanwhile.

Rules: a live server on 127.0.0.1 port 0 over the fake backend and a real byte-level BPE tokenizer built in
the test; the huge prompt's tokenizing waits at a gate (a threading.Event the test opens) so the check is
one of order, not of time: if tokenizing ran on the event loop, the loop itself would wait at the gate and
nothing else could happen until the gate gave up. Every wait is under `trio.fail_after`; the lane core's
books are checked when the server stops.
"""

import threading

import httpx
import trio

from golden_server import HELLO, fake_service
from lanes.http.offload import OFF_LOOP_CHARS, text_size
from lanes.text.tokenizer import Tokenizer
from server_helpers import serving
from tiny import write_tokenizer

CHAT = "/v1/chat/completions"
GATE_GIVES_UP = 20.0  # seconds the gate holds a tokenizing that nothing releases (it ran on the loop)


class GatedTokenizer(Tokenizer):
    """The real tokenizer; its encoding of a chat past the off-loop size waits at a gate first."""

    def gate(self) -> None:
        self.entered, self.release, self.order = threading.Event(), threading.Event(), []

    def encode_chat(self, messages, **options):
        if text_size(messages) >= OFF_LOOP_CHARS:
            self.order.append("tokenizing")
            self.entered.set()
            self.order.append("released" if self.release.wait(GATE_GIVES_UP) else "the gate gave up")
        return super().encode_chat(messages, **options)


async def test_other_streams_get_events_while_a_huge_prompt_is_tokenized(tmp_path):
    service, backend = fake_service(tmp_path, lanes=2, blocks=1024, max_model_len=4096)
    gated = GatedTokenizer.from_folder(tmp_path, write_tokenizer(tmp_path))
    gated.gate()
    service.tokenizer = gated  # the same files' tokenizer, with the gate
    service.max_body = 1 << 20  # room for the huge prompt (the golden tests' server takes 64 KiB)
    huge = [{"role": "user", "content": "lorem ipsum " * 10_000}]  # 120,000 characters, past 100k tokens here
    answer = {}
    async with serving(service) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            with trio.fail_after(60):
                small = {"messages": HELLO, "max_tokens": 2000, "ignore_eos": True, "stream": True}
                async with http.stream("POST", CHAT, json=small) as streamed:
                    lines = streamed.aiter_lines()
                    while not (await anext(lines)).startswith("data: {"):
                        pass

                    async def big() -> None:
                        reply = await http.post(CHAT, json={"messages": huge, "max_tokens": 4})
                        answer.update(status=reply.status_code, code=reply.json()["error"]["code"])

                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(big)
                        await trio.to_thread.run_sync(gated.entered.wait, abandon_on_cancel=True)
                        at_entry = len(backend.plans)
                        seen = 0
                        while len(backend.plans) < at_entry + 5 or seen < 5:  # five passes, and their events read
                            line = await anext(lines)
                            seen += line.startswith("data: {") and len(backend.plans) > at_entry
                        gated.order.append("five passes streamed")
                        gated.release.set()
    assert gated.order == ["tokenizing", "five passes streamed", "released"]
    assert answer == {"status": 400, "code": "context_length_exceeded"}
