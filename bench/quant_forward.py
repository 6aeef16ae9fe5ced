"""The default model's forward with its GGUF weights kept quantized (lanes.quant) beside today's fp32 forward.

    python bench/quant_forward.py [--model M] [--new 64] [--lanes 1,8] [--steps 32] [--rounds 5]

Until the model parts take `lanes.quant` weights, this script stands in for them: a `Decoder` whose
matmuls, embedding and head call the weights' `matmul` / `take` (the same code as the decoder's,
otherwise), over the same KV cache layout. It checks that the greedy continuation of the chat reference
prompt is token for token today's, prints the largest logit difference over that continuation, and
times decode steps at each lane count, both decoders interleaved in the same process (median of rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lanes.checkpoint.gguf_source import hf_name, unpermute
from lanes.core.passes import Piece
from lanes.families.decoder import Decoder, rms_norm
from lanes.families.rope import apply_rotary
from lanes.gpu.attention import paged_attention, write_kv
from lanes.gpu.blocks import BlockPool, BlockTable
from lanes.gpu.device import choose
from lanes.gpu.kv import KVCache
from lanes.loader import load_model
from lanes.models import resolve_model
from lanes.quant import from_gguf, stack_rows

QUESTION = "What is the capital of France? Answer in one sentence."


class QuantDecoder(Decoder):
    """Today's decoder with every matrix a `lanes.quant` weight (one shard, no biases or q/k norms)."""

    def __init__(self, base: Decoder, weights: dict, kv: KVCache) -> None:
        super().__init__(base.config, base.weights, kv, base.comm, base.shard)
        self.q = weights

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.q["embed"].take(tokens, self.dtype)

    def attention(self, index, layer, h, cos, sin, paged):
        t, d = h.shape[0], self.config.head_dim
        qkv = self.q[index]["qkv"].matmul(h)  # [T, (hq + 2 hkv) * D]
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = q.view(t, self.heads, d), k.view(t, self.kv_heads, d), v.reshape(t, self.kv_heads, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache_k, cache_v = self.kv.layer(index)
        write_kv(cache_k, cache_v, paged, k, v)
        out = paged_attention(q, cache_k, cache_v, paged, self.scale).reshape(t, self.heads * d)
        return self.q[index]["o"].matmul(out)

    def mlp(self, layer, h):
        index = next(i for i, l in enumerate(self.weights.layers) if l is layer)
        gate, up = self.q[index]["gate_up"].matmul(h).chunk(2, dim=-1)
        return self.q[index]["down"].matmul(F.silu(gate) * up)

    def logits(self, rows):
        return self.q["head"].matmul(rms_norm(rows, self.weights.norm, self.config.rms_eps))


def quant_weights(model) -> dict:
    """The GGUF file's matrices as lanes.quant weights: q/k rows unpermuted, q/k/v and gate/up stacked."""
    file, config = model.checkpoint.gguf, model.config
    by_hf = {hf_name(g): g for g in file.tensors}

    def weight(hf: str):
        g = by_hf[hf]
        w = from_gguf(file.tensors[g].data, file.tensors[g].tensor_type, file.shape(g), torch.float32)
        for part, heads in ((".q_proj.", config.heads), (".k_proj.", config.kv_heads)):
            if part in hf:  # llama.cpp's row permutation, undone on row indices
                w = w.rows(unpermute(torch.arange(w.shape[0])[:, None], heads)[:, 0])
        return w

    out: dict = {"embed": weight("model.embed_tokens.weight")}
    out["head"] = weight("lm_head.weight") if "lm_head.weight" in by_hf else out["embed"]
    for i in range(config.layers):
        p = f"model.layers.{i}."
        out[i] = {
            "qkv": stack_rows([weight(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
            "o": weight(p + "self_attn.o_proj.weight"),
            "gate_up": stack_rows([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")]),
            "down": weight(p + "mlp.down_proj.weight"),
        }
    return out


def greedy(decoder, prompt: list[int], new: int, blocks: int) -> tuple[list[int], list[torch.Tensor]]:
    pool, table = BlockPool(blocks), BlockTable(("lane", 0))
    table.grow(pool, len(prompt))
    logits = decoder.forward([Piece(0, tuple(prompt), 0, tuple(table.blocks))])
    tokens, seen = [], [logits[0]]
    for _ in range(new):
        tokens.append(int(logits[0].argmax()))
        table.grow(pool, 1)
        logits = decoder.forward([Piece(0, (tokens[-1],), table.tokens - 1, tuple(table.blocks))])
        seen.append(logits[0])
    table.clear(pool)
    return tokens, seen


def decode_steps(decoder, lanes: int, steps: int, blocks: int, prompt_len: int = 64) -> float:
    """Seconds a decode step at `lanes` rows, after a prompt of `prompt_len` tokens each."""
    pool = BlockPool(blocks)
    tables = [BlockTable(("lane", i)) for i in range(lanes)]
    for t in tables:
        t.grow(pool, prompt_len)
    decoder.forward([Piece(i, tuple(range(10, 10 + prompt_len)), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
    start = time.perf_counter()
    for _ in range(steps):
        pieces = []
        for i, t in enumerate(tables):
            t.grow(pool, 1)
            pieces.append(Piece(i, (100 + i,), t.tokens - 1, tuple(t.blocks)))
        decoder.forward(pieces)
    took = time.perf_counter() - start
    for t in tables:
        t.clear(pool)
    return took / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--lanes", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.lanes.split(",")]
    blocks = max(counts) * 16 + 16
    model = load_model(resolve_model(args.model), choose("cpu", "fp32"), kv_blocks=blocks)
    quant = QuantDecoder(model.decoder, quant_weights(model), KVCache(model.decoder.kv.shape, blocks, device="cpu", dtype=torch.float32))
    fp32_bytes = sum(t.nbytes for t in [model.decoder.weights.embed] + [w for l in model.decoder.weights.layers
                     for w in (l.qkv, l.o, l.gate_up, l.down)])
    q_bytes = quant.q["embed"].resident_bytes + sum(quant.q[i][k].resident_bytes for i in range(model.config.layers)
                                                    for k in ("qkv", "o", "gate_up", "down"))
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    with torch.inference_mode():
        ref_tokens, ref_logits = greedy(model.decoder, list(prompt), args.new, blocks)
        q_tokens, q_logits = greedy(quant, list(prompt), args.new, blocks)
        same = next((i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens)) if a != b), None)
        agree = len(ref_logits) if same is None else same + 1  # logits compared while the inputs agree
        diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits[:agree], q_logits[:agree]))
        times = {(name, n): [] for name in ("fp32", "quant") for n in counts}
        for _ in range(args.rounds):
            for n in counts:
                for name, decoder in (("fp32", model.decoder), ("quant", quant)):
                    times[(name, n)].append(decode_steps(decoder, n, args.steps, blocks))
    end = next((i for i, t in enumerate(q_tokens) if t in model.tokenizer.eos_ids), len(q_tokens))
    text = model.tokenizer.decode(q_tokens[:end])
    print(f"\nweights: fp32 {fp32_bytes / 1e6:.0f} MB, kept quantized {q_bytes / 1e6:.0f} MB "
          f"(file {sum(t.n_bytes for t in model.checkpoint.gguf.tensors.values()) / 1e6:.0f} MB)")
    print(f"greedy {args.new} tokens: {'identical' if same is None else f'first differ at {same}'}; "
          f"largest logit difference {diff:.2e} over {agree} positions; text: {text[:80]!r}")
    print(f"{'lanes':>5} {'fp32 ms/step':>13} {'quant ms/step':>14} {'speed-up':>9}")
    for n in counts:
        a, b = statistics.median(times[("fp32", n)]), statistics.median(times[("quant", n)])
        print(f"{n:>5} {a * 1e3:>13.2f} {b * 1e3:>14.2f} {a / b:>9.2f}")


if __name__ == "__main__":
    main()
