"""The default model end to end: SmolLM2-135M-Instruct's Q4_1 GGUF, fetched by the README's test command.

Rules: fp32 on the CPU; the model is loaded once for the module; against transformers' GGUF loader on the
same file, the same greedy token at every row of the prompt (its Q4_1 and Q8_0 products round activations
to 8 bits a group of 32, as llama.cpp's do: over 30 layers that moves logits of up to ~38 by up to ~3,
and a reference rounding them too cannot follow ours through near ties, so the logits are bounded, not
matched; test_quant_model.py matches them on tiny models); the greedy answer is the one transformers gives.
"""

import pytest
import torch
import trio

from lanes.generate import greedy
from lanes.core.blocks import BlockPool, BlockTable
from lanes.core.passes import Piece
from lanes.gpu.device import CpuRunner, choose
from lanes.loader import load_model
from lanes.models import resolve_model

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2():
    return load_model(resolve_model(None), choose("cpu", "fp32"), kv_blocks=256, quiet=True)


def test_family_and_shape(smollm2):
    config = smollm2.config
    assert (config.family, config.layers, config.hidden_size, config.heads, config.kv_heads) == ("llama", 30, 576, 9, 3)
    assert (config.vocab_size, config.tie_embeddings) == (49152, True)


async def chat_answer(model) -> str:
    """The model's greedy answer to QUESTION, which must end at an EOS within 32 tokens."""
    tokenizer = model.tokenizer
    prompt = tokenizer.encode_prompt(tokenizer.render_chat([{"role": "user", "content": QUESTION}]))
    with trio.fail_after(120):
        tokens = [t async for t in greedy(model, CpuRunner(), prompt, 32)]
    assert tokens[-1] in tokenizer.eos_ids
    return tokenizer.decode(tokens)


async def test_greedy_chat_answer(smollm2):
    assert await chat_answer(smollm2) == "The capital of France is Paris."


def test_logits_equal_transformers_gguf_loader(smollm2):
    from transformers import AutoModelForCausalLM

    path = resolve_model(None)
    # in float64, so the bound measures our fp32 sums alone, not also the reference's (whose order varies by CPU)
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float64).eval()
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode_prompt(tokenizer.render_chat([{"role": "user", "content": QUESTION}]))
    pool = BlockPool(smollm2.kv_blocks)
    table = BlockTable(("lane", 0))
    table.grow(pool, len(prompt))
    ours = smollm2.decoder.forward([Piece(0, tuple(prompt), 0, tuple(table.blocks), "all")])
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0].float()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (ours - theirs).abs().max() < 0.1 * theirs.abs().max()  # 3.1 of 37.6 measured
    table.clear(pool)
    pool.check_integrity()


async def test_greedy_chat_answer_over_an_fp8_cache():
    """`--kv-cache fp8` on the default model: its keys and values in e4m3 leave the chat answer as it is."""
    model = load_model(resolve_model(None), choose("cpu", "fp32"), kv_blocks=64, quiet=True, kv_cache="fp8")
    assert model.decoder.kv.fp8
    assert await chat_answer(model) == "The capital of France is Paris."
