"""vLLM's request parameters on the lane core: min_tokens, stop_token_ids, include_stop_str_in_output,
logit_bias rows kept off the plain-greedy paths, and max_tokens 0 (the prompt's logprobs, nothing drawn).

Rules: the fake backend (greedy draws depend on the whole context; it masks min_tokens' ids as the
sampler does; its text is "t<id> " a token); references are each stream's own solo run without the
parameter, cut by vLLM's rules (test_stops' `cut_after`); exact tokens, texts, plans and events; books
checked and every block free at the end (engine_helpers.running); under `trio.fail_after`.
"""

import pytest
import trio

from engine_helpers import collect, greedy, prompt, running, solo
from lanes.core.fake import FakeBackend
from lanes.core.stream import Finished, PromptLogprobs, PromptTooLong, Request, TokenEvent
from test_stops import cut_after

PROMPT = prompt(6)


def texts(tokens: list[int]) -> list[str]:
    return [f"t{token} " for token in tokens]


async def natural(max_tokens: int = 10) -> list[int]:
    """The greedy tokens of PROMPT with nothing ending them early."""
    return (await solo(Request(PROMPT, greedy(max_tokens, ignore_eos=True)))).tokens


async def test_stop_token_ids_end_the_stream_without_their_text():
    tokens = await natural()
    stop = tokens[3]
    out = await solo(Request(PROMPT, greedy(10, ignore_eos=True, stop_token_ids=(stop,))))
    first = tokens.index(stop)
    assert out.tokens == tokens[: first + 1] and out.text == "".join(texts(tokens[:first]))
    assert out.last.reason == "stop" and out.last.completion_tokens == first + 1


async def test_min_tokens_masks_stop_ids_then_lets_them_end_the_stream():
    # Every id but 0 and 1 stops: the first three draws are pushed onto 0 or 1, the fourth may stop.
    stops = tuple(range(2, 50))
    early = await solo(Request(PROMPT, greedy(10, ignore_eos=True, stop_token_ids=stops)))
    assert len(early.tokens) == 1 and early.last.reason == "stop"
    out = await solo(Request(PROMPT, greedy(10, ignore_eos=True, stop_token_ids=stops, min_tokens=3)))
    assert all(token in (0, 1) for token in out.tokens[:3])
    assert len(out.tokens) == 4 and out.tokens[3] in stops and out.last.reason == "stop"
    assert out.text == "".join(texts(out.tokens[:3]))
    with_eos = await solo(Request(PROMPT, greedy(10, min_tokens=3)))  # EOS is masked too, unless ignore_eos
    assert 1 not in with_eos.tokens[:3]


async def test_stop_strings_in_the_first_min_tokens_tokens_do_not_end_the_stream():
    tokens = await natural(12)
    stop = f"t{tokens[1]} "
    pieces = texts(tokens)
    for min_tokens in (0, 1, 2, 5):
        out = await solo(Request(PROMPT, greedy(12, ignore_eos=True, stop=(stop,), min_tokens=min_tokens)))
        expected, stopped = cut_after("".join(pieces), [stop], len("".join(pieces[:min_tokens])), False)
        assert out.text == expected and (out.last.reason == "stop") == stopped
        assert out.text.startswith("".join(pieces[:min_tokens]))


async def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text():
    tokens = await natural()
    pieces = texts(tokens)
    stop = pieces[2][:2]  # "t" and the first digit: the string completes inside the third token's text
    out = await solo(Request(PROMPT, greedy(10, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True)))
    assert out.text == cut_after("".join(pieces), [stop], 0, True)[0] and out.text.endswith(stop)
    by_id = await solo(Request(PROMPT, greedy(10, ignore_eos=True, stop_token_ids=(tokens[2],),
                                              include_stop_str_in_output=True)))
    first = tokens.index(tokens[2])
    assert by_id.tokens == tokens[: first + 1] and by_id.text == "".join(pieces[: first + 1])
    assert [e.text for e in by_id.events if isinstance(e, TokenEvent)][-1] == pieces[first]


async def test_rows_with_a_bias_or_min_tokens_are_never_fed():
    """Fed passes carry plain greedy rows only: a bias changes the argmax the device would take."""
    for extra, fed in (({}, True), ({"logit_bias": ((5, 0.5),)}, False), ({"min_tokens": 2}, False)):
        backend = FakeBackend(lanes=2, blocks=64, feeds=True)
        async with running(backend) as core:
            await collect(await core.submit(Request(PROMPT, greedy(8, ignore_eos=True, **extra))))
        assert any(p.fed for p in backend.plans) == fed, extra


async def test_max_tokens_0_prefills_the_prompt_with_its_logprobs_and_draws_nothing():
    long = prompt(41, first=3)  # three chunks of 16 rows, the last ending inside a block
    backend = FakeBackend(lanes=2, blocks=64)
    async with running(backend, max_rows=16) as core:
        out = await collect(await core.submit(Request(long, greedy(0, prompt_logprobs=True))))
        one = await collect(await core.submit(Request(long, greedy(1, prompt_logprobs=True))))
    assert [type(e) for e in out.events] == [PromptLogprobs, Finished]
    assert out.events[0] == one.events[0] and len(out.events[0].logprobs) == 41 and out.events[0].logprobs[0] is None
    assert out.last == Finished("length", "", prompt_tokens=41, completion_tokens=0)
    assert [len(p.work[0].piece.tokens) for p in backend.plans[:3]] == [16, 16, 9]
    assert backend.plans[2].work[0].sample is None and backend.plans[2].work[0].piece.logits == "all"


async def test_max_tokens_0_without_logprobs_fills_the_prompt_cache_and_may_take_the_whole_context():
    backend = FakeBackend(lanes=1, blocks=4, max_model_len=48)
    async with running(backend, max_rows=64, cache_bytes=64) as core:
        out = await collect(await core.submit(Request(prompt(48), greedy(0))))
        assert [type(e) for e in out.events] == [Finished] and out.last.reason == "length"
        assert backend.plans[0].work[0].piece.logits == "none"
        again = await collect(await core.submit(Request(prompt(40), greedy(2, ignore_eos=True))))
        assert again.last.cached_tokens == 32  # the two full blocks the first prompt kept
        with pytest.raises(PromptTooLong, match="needs 49 tokens of context, the limit is 48"):
            await core.submit(Request(prompt(48), greedy(1)))


async def test_max_tokens_0_streams_beside_decoding_ones_change_nothing():
    requests = [Request(prompt(9, first=i), greedy(7, ignore_eos=True)) for i in range(3)]
    alone = [await solo(r) for r in requests]
    backend = FakeBackend(lanes=3, blocks=64)
    async with running(backend, max_rows=8) as core:
        streams = [await core.submit(requests[0]), await core.submit(Request(prompt(30), greedy(0, prompt_logprobs=True)))]
        streams += [await core.submit(r) for r in requests[1:]]
        with trio.fail_after(30):
            outcomes = [await collect(s) for s in streams]
    assert [o.tokens for o in outcomes[:1] + outcomes[2:]] == [a.tokens for a in alone]
    assert outcomes[1].tokens == [] and outcomes[1].last.reason == "length"
