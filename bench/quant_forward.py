"""The default model with its GGUF weights kept quantized beside the same file dequantized to fp32 at load.

    python bench/quant_forward.py [--model M] [--new 64] [--lanes 1,8] [--steps 32] [--rounds 5]

Both are `lanes.loader.load_model` of one file: as the server loads it (block formats kept, lanes.quant's
kernels), and with the kernels turned away for the second load (every tensor dequantized by the gguf
package, the path a machine without AVX-512 takes). It checks that the greedy continuation of the chat
reference prompt is token for token the dequantized model's, prints the largest logit difference over it,
and times decode steps at each lane count, the two interleaved in one process (median of rounds).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import gguf
import torch

import lanes.quant.build
from lanes.core.blocks import BlockPool, BlockTable
from lanes.core.passes import Piece
from lanes.gpu.device import choose
from lanes.loader import load_model
from lanes.models import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_step import step_ms  # noqa: E402

QUESTION = "What is the capital of France? Answer in one sentence."


def dequantized(path: Path, blocks: int):
    """The file loaded with every tensor dequantized (the kernels reported unavailable for this load)."""
    keep = lanes.quant.build.unavailable_reason
    lanes.quant.build.unavailable_reason = lambda: "turned away for the comparison"
    try:
        return load_model(path, choose("cpu", "fp32"), kv_blocks=blocks)
    finally:
        lanes.quant.build.unavailable_reason = keep


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
    pool.check_integrity()
    return tokens, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--lanes", default="1,8")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.lanes.split(",")]
    blocks = max(counts) * ((64 + args.steps) // 16 + 2) + (args.new + 64) // 16 + 8
    path = resolve_model(args.model)
    quant = load_model(path, choose("cpu", "fp32"), kv_blocks=blocks)
    dense = dequantized(path, blocks)
    prompt = quant.tokenizer.encode_chat([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ref_tokens, ref_logits = greedy(dense.decoder, list(prompt), args.new, blocks)
    q_tokens, q_logits = greedy(quant.decoder, list(prompt), args.new, blocks)
    same = next((i for i, (a, b) in enumerate(zip(ref_tokens, q_tokens)) if a != b), None)
    agree = len(ref_logits) if same is None else same + 1  # logits compared while the inputs agree
    diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits[:agree], q_logits[:agree]))
    times = {(name, n): [] for name in ("fp32", "quant") for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            for name, model in (("fp32", dense), ("quant", quant)):
                times[(name, n)].append(step_ms(model.decoder, n, args.steps, blocks, 64, model.config.vocab_size))
    end = next((i for i, t in enumerate(q_tokens) if t in quant.tokenizer.eos_ids), len(q_tokens))
    text = quant.tokenizer.decode(q_tokens[:end])
    file_bytes = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)
    print(f"\nweights: dequantized {dense.weights_census().resident_bytes / 1e6:.0f} MB, kept quantized "
          f"{quant.weights_census().resident_bytes / 1e6:.0f} MB (the file's tensors: {file_bytes / 1e6:.0f} MB)")
    print(f"greedy {args.new} tokens: {'identical' if same is None else f'first differ at {same}'}; "
          f"largest logit difference {diff:.2e} over {agree} positions; text: {text[:80]!r}")
    print(f"{'lanes':>5} {'fp32 ms/step':>13} {'quant ms/step':>14} {'speed-up':>9}")
    for n in counts:
        a, b = statistics.median(times[("fp32", n)]), statistics.median(times[("quant", n)])
        print(f"{n:>5} {a:>13.2f} {b:>14.2f} {a / b:>9.2f}")


if __name__ == "__main__":
    main()
