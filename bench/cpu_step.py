"""A CPU decode step's cost, and how much of it is per-pass Python and op dispatch rather than arithmetic.

    python bench/cpu_step.py [--model M] [--lanes 1,8] [--rows 1] [--steps 32] [--rounds 5] [--prompt-len 64]

Two decoders of the default model's layout (30 layers, 9 query and 3 KV heads) over the lanes' own
forward (`Decoder.forward`, the CPU path): the model itself (its GGUF weights kept quantized), and a
stand-in built here with every width cut to 64 (hidden 64, heads of 16, intermediate 64, vocabulary 64),
whose arithmetic is next to nothing, so its step time is the overhead the 30 layers' ops cost whatever
their size. `--rows 9` gives each lane 9 rows a step (a drafted lane's 1 + 8). Rounds interleave the two;
each figure is the median round's mean step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lanes  # noqa: F401  (first: it sets OpenMP's wait policy before torch loads libgomp)
import torch
from lanes.core.blocks import BlockPool, BlockTable
from lanes.core.passes import Piece
from lanes.gpu.device import choose
from lanes.loader import load_model
from lanes.models import resolve_model


def stand_in(folder: Path, layers: int) -> Path:
    """A llama folder of `layers` layers at width 64 (random weights), with a stand-in tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


def step_ms(decoder, lanes: int, steps: int, blocks: int, prompt_len: int, vocab: int, rows: int = 1) -> float:
    """Mean ms of a decode step of `rows` rows a lane at `lanes` lanes after a prompt of `prompt_len` tokens each."""
    pool = BlockPool(blocks)
    tables = [BlockTable(("lane", i)) for i in range(lanes)]
    for t in tables:
        t.grow(pool, prompt_len)
    decoder.forward([Piece(i, tuple(j % vocab for j in range(prompt_len)), 0, tuple(t.blocks)) for i, t in enumerate(tables)])
    start = time.perf_counter()
    for _ in range(steps):
        pieces = []
        for i, t in enumerate(tables):
            t.grow(pool, rows)
            pieces.append(Piece(i, tuple((7 + i + j) % vocab for j in range(rows)), t.tokens - rows, tuple(t.blocks)))
        decoder.forward(pieces)
    took = time.perf_counter() - start
    for t in tables:
        t.clear(pool)
    pool.check_integrity()
    return took / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--lanes", default="1,8")
    parser.add_argument("--rows", type=int, default=1, help="rows a lane a step")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args()
    counts = [int(n) for n in args.lanes.split(",")]
    blocks = max(counts) * ((args.prompt_len + args.steps * args.rows) // 16 + 2) + 8
    placement = choose("cpu", "auto")
    model = load_model(resolve_model(args.model), placement, kv_blocks=blocks)
    with tempfile.TemporaryDirectory() as scratch:
        print(f"building the {model.config.layers}-layer stand-in at width 64 ...", file=sys.stderr)
        tiny = load_model(stand_in(Path(scratch), model.config.layers), placement, kv_blocks=blocks, quiet=True)
    contenders = {"model": model, "width 64": tiny}
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in contenders for n in counts}
    for r in range(args.rounds + 1):  # the first round warms up, untimed
        for n in counts:
            for name, loaded in contenders.items():
                ms = step_ms(loaded.decoder, n, args.steps, blocks, args.prompt_len, loaded.config.vocab_size, args.rows)
                if r:
                    times[(name, n)].append(ms)
    weights = model.weights_census()
    print(f"\n{model.checkpoint.path.name}: {model.config.layers} layers, weights {weights.resident_bytes / 1e6:.0f} MB "
          f"({', '.join(f'{k} x{v}' for k, v in sorted(weights.tensors.items()))}); {torch.get_num_threads()} threads")
    print(f"{args.rows} rows a lane a step")
    print(f"{'lanes':>5} {'model ms/step':>14} {'width-64 ms/step':>17} {'overhead share':>15}")
    for n in counts:
        full, small = statistics.median(times[("model", n)]), statistics.median(times[("width 64", n)])
        print(f"{n:>5} {full:>14.2f} {small:>17.2f} {small / full:>15.2f}")


if __name__ == "__main__":
    main()
