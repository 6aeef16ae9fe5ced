"""vLLM's request parameters on a real (tiny) torch model: logit_bias, min_tokens with stop_token_ids,
skip_special_tokens and max_tokens 0, each against transformers on the same checkpoint.

Rules: a tiny random llama built in the test with transformers (its tokenizer has ChatML's specials);
references are transformers' greedy `generate()` with `sequence_bias` (single-token biases) and
`min_new_tokens`, its forward's log_softmax and its tokenizer's `decode`; exact token equality; fp32;
on CUDA the captured graphs and fed passes are on, so biased rows must leave their plain-greedy path;
every I/O wait under `trio.fail_after`; `check_integrity()` on exit (the `running` helper).
"""

import pytest
import torch
import trio
from transformers import AutoTokenizer

import tiny
from engine_helpers import collect, running
from lanes.core.sampling import SamplingParams
from lanes.core.stream import PromptLogprobs, Request
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.gpu.device import choose, cuda_device_count, runner_for
from lanes.loader import load_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device"))]
PROMPTS = [tuple(range(5, 17)), (40, 41, 7, 9, 120, 3), tuple(range(60, 93, 3))]


@pytest.fixture(scope="module", params=DEVICES)
def tiny_model(request, tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny.build("llama", folder, num_hidden_layers=2, max_position_embeddings=256)
    reference.generation_config.eos_token_id = None
    model = load_model(folder, choose(request.param, "fp32"), kv_blocks=160, quiet=True)
    return model, reference, AutoTokenizer.from_pretrained(folder)


async def run(model, requests, lanes=3):
    backend = TorchBackend(model, runner_for(model.placement), lanes=lanes, max_model_len=256)
    async with running(backend, text=text_factory(model.tokenizer), stop_ids=model.tokenizer.eos_ids, max_rows=32) as core:
        with trio.fail_after(120):
            streams = [await core.submit(r) for r in requests]
            return [await collect(s) for s in streams]


def generate(reference, prompt, n: int, **options) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, pad_token_id=0, **options)
    return out[0, len(prompt):].tolist()


async def test_logit_bias_draws_what_transformers_draws_with_the_same_bias(tiny_model):
    model, reference, _ = tiny_model
    plain = [generate(reference, p, 8) for p in PROMPTS]
    # Push each prompt's first greedy token out, pull another token in, and leave a plain stream beside them.
    biases = [((plain[0][0], -100.0), (plain[0][0] + 1, 1.5)), ((plain[1][0], -100.0), (7, 100.0)), ()]
    requests = [Request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=b))
                for p, b in zip(PROMPTS, biases)]
    outcomes = await run(model, requests)
    expected = [generate(reference, p, 8, sequence_bias=[[[t], v] for t, v in b]) if b else plain[2]
                for p, b in zip(PROMPTS, biases)]
    assert [o.tokens for o in outcomes] == expected
    assert outcomes[1].tokens == [7] * 8 and outcomes[0].tokens[0] != plain[0][0]
    assert outcomes[2].tokens == plain[2]


async def test_min_tokens_holds_a_stop_id_off_as_transformers_min_new_tokens(tiny_model):
    model, reference, _ = tiny_model
    prompt = PROMPTS[0]
    first = generate(reference, prompt, 1)[0]
    early, held = await run(model, [
        Request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=(first,))),
        Request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=(first,), min_tokens=3))])
    assert early.tokens == [first] and early.last.reason == "stop"
    expected = generate(reference, prompt, 10, min_new_tokens=3, eos_token_id=first)
    assert held.tokens == expected and first not in held.tokens[:3]
    assert held.last.reason == ("stop" if expected[-1] == first and len(expected) < 10 else "length")


async def test_special_tokens_give_their_text_only_when_not_skipped(tiny_model):
    model, _, theirs = tiny_model
    start = model.tokenizer.token_to_id("<|im_start|>")
    forced = dict(temperature=0, max_tokens=4, ignore_eos=True, logit_bias=((start, 100.0),))
    skipped, shown = await run(model, [Request(PROMPTS[0], SamplingParams(**forced)),
                                       Request(PROMPTS[0], SamplingParams(**forced, skip_special_tokens=False))])
    assert skipped.tokens == shown.tokens == [start] * 4
    assert skipped.text == theirs.decode(skipped.tokens, skip_special_tokens=True) == ""
    assert shown.text == theirs.decode(shown.tokens, skip_special_tokens=False) == "<|im_start|>" * 4


async def test_max_tokens_0_gives_the_prompts_logprobs_as_transformers_and_nothing_else(tiny_model):
    model, reference, _ = tiny_model
    prompt = tuple(range(5, 45))
    (outcome,) = await run(model, [Request(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=True))])
    assert outcome.tokens == [] and outcome.last.reason == "length" and len(outcome.events) == 2
    logprobs = outcome.events[0]
    assert isinstance(logprobs, PromptLogprobs) and logprobs.logprobs[0] is None
    with torch.no_grad():
        full = reference(torch.tensor([list(prompt)])).logits[0].log_softmax(-1)
    assert logprobs.logprobs[1:] == pytest.approx([full[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)
