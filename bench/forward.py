"""Prefill and decode tokens/s of our forward beside transformers' forward of the same model, in one run.

    python bench/forward.py [--model M] [--prompts 4] [--prompt-len 128] [--lanes 8] [--steps 32] [--device cpu]
                            [--only dense|moe] [--experts-implementation eager|grouped_mm|batched_mm]

Both sides run the same checkpoint in the same dtype on the same device and threads. Prefill: `--prompts`
prompts of `--prompt-len` tokens in one pass. Decode: `--lanes` sequences at context `--prompt-len`, one
token each a step (ours through the paged KV cache, transformers through its DynamicCache). Two models:
`--model` (the default model unless given), and a Qwen3-MoE config built here with random weights (MOE:
64 experts, 8 a token, 6 layers of width 512). Prints one table with the ratio ours / transformers; the
median of `--repeat` timed runs of each side after one warm-up, the two sides taken in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lanes.core.passes import Piece
from lanes.core.blocks import BlockPool, BlockTable
from lanes.gpu.device import choose
from lanes.loader import load_model
from lanes.models import resolve_model

from bench_reference import reference_model


def paired(ours, theirs, repeat: int) -> tuple[float, float]:
    """Median seconds of each of two runs that time themselves, after one warm-up each, taken in turn so
    that a busy machine slows both alike."""
    ours(), theirs()
    times = [(ours(), theirs()) for _ in range(repeat)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def timed(fn, sync):
    """`fn` as a run that returns its own seconds."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    return run


MOE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128,
           norm_topk_prob=True, max_position_embeddings=2048)  # Qwen3-30B-A3B's expert ratios (128 / 8), smaller


def moe_checkpoint(folder: Path) -> tuple[Path, str]:
    """A Qwen3-MoE folder of config MOE with transformers' random initialisation and a stand-in tokenizer;
    returns it with a name for the table."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**MOE))
    model.save_pretrained(folder)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder, f"qwen3-moe {MOE['num_experts']}x{MOE['num_experts_per_tok']} ({millions:.0f}M)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--only", choices=("dense", "moe"), default=None)
    parser.add_argument("--experts-implementation", default=None, help="transformers' MoE experts (default: its own)")
    args = parser.parse_args()

    placement = choose(args.device, args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.only != "moe":
            path = resolve_model(args.model)
            rows += measure(path, path.name, placement, args)
        if args.only != "dense":
            print("building the Qwen3-MoE config ...", file=sys.stderr)
            rows += measure(*moe_checkpoint(Path(scratch)), placement, args)

    print(f"\non {placement.describe()}, {torch.get_num_threads()} threads")
    print(f"{'model':<32} {'phase':<22} {'lanes tok/s':>12} {'transformers tok/s':>19} {'ratio':>7}")
    for model, name, mine, ref in rows:
        print(f"{model:<32} {name:<22} {mine:>12.1f} {ref:>19.1f} {mine / ref:>7.2f}")


def measure(path: Path, label: str, placement, args) -> list[tuple[str, str, float, float]]:
    """(model, phase, our tok/s, transformers' tok/s) for prefill and decode of the checkpoint at `path`."""
    sync = (lambda: torch.cuda.synchronize()) if placement.is_cuda else (lambda: None)
    ours = load_model(path, placement, kv_blocks=(args.lanes + args.prompts) * ((args.prompt_len + args.steps) // 16 + 2))
    print("loading the transformers reference ...", file=sys.stderr)
    theirs = reference_model(path, placement, args.experts_implementation)
    generator = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size
    prompts = torch.randint(0, vocab, (max(args.prompts, args.lanes), args.prompt_len), generator=generator)
    pool = BlockPool(ours.kv_blocks)

    def ours_prefill():
        tables = [BlockTable(("lane", i)) for i in range(args.prompts)]
        for t in tables:
            t.grow(pool, args.prompt_len)
        ours.decoder.prefill_many([Piece(i, tuple(prompts[i].tolist()), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
        for t in tables:
            t.clear(pool)

    def theirs_prefill():
        with torch.no_grad():
            theirs(prompts[: args.prompts].to(placement.device), logits_to_keep=1)

    def ours_decode():
        tables = [BlockTable(("lane", i)) for i in range(args.lanes)]
        for t in tables:
            t.grow(pool, args.prompt_len)
        last = ours.decoder.prefill_many([Piece(i, tuple(prompts[i].tolist()), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            tokens = last.argmax(-1).tolist()
            pieces = []
            for i, t in enumerate(tables):
                t.grow(pool, 1)
                pieces.append(Piece(i, (tokens[i],), t.tokens - 1, tuple(t.blocks)))
            last = ours.decoder.decode(pieces)
        sync()
        for t in tables:
            t.clear(pool)
        return time.perf_counter() - start

    def theirs_decode():
        with torch.no_grad():
            out = theirs(prompts[: args.lanes].to(placement.device), use_cache=True, logits_to_keep=1)
            cache, last = out.past_key_values, out.logits[:, -1]
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                out = theirs(last.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
                cache, last = out.past_key_values, out.logits[:, -1]
            sync()
        return time.perf_counter() - start

    rows = []
    model = label
    prefill_tokens = args.prompts * args.prompt_len
    a, b = paired(timed(ours_prefill, sync), timed(theirs_prefill, sync), args.repeat)
    rows.append((model, f"prefill {args.prompts}x{args.prompt_len}", prefill_tokens / a, prefill_tokens / b))
    a, b = paired(ours_decode, theirs_decode, args.repeat)
    decode_tokens = args.lanes * args.steps
    rows.append((model, f"decode {args.lanes} lanes @{args.prompt_len}", decode_tokens / a, decode_tokens / b))
    pool.check_integrity()
    return rows


if __name__ == "__main__":
    main()
