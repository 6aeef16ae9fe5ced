"""Grammars on the GPU: what constrained decoding adds to a decode step at 64 streams, in one run.

    python bench/grammar_gpu.py --tokenizer tokenizer.json [--streams 64] [--new 48] [--device cuda]

A Qwen2.5-0.5B-shaped decoder with random bf16 weights from a fixed seed, saved with the given
tokenizer.json (a real one, since llguidance reads its byte-level tokens: for example the default model's,
written by `open_checkpoint(resolve_model(None)).tokenizer().to_json()`). The same 64 streams, sampled (temperature 0.7, seeded), run with bench/grammar.py's
four schemas (a JSON object is longer than `--new` tokens, so they rarely end early) and without, in turn, twice each. Prints a pass's mean time each way, the time the sampler
waited on the masks after the forward (the mask work not hidden behind the forward), and both as a share
of the unconstrained pass. `--device cpu` checks the script with a small shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from engine_helpers import collect, running  # noqa: E402
from grammar import PROMPTS, SCHEMAS  # noqa: E402
from lanes.backend.torch_backend import TorchBackend, text_factory  # noqa: E402
from lanes.core.blocks import blocks_for  # noqa: E402
from lanes.core.grammar import LaneGrammars  # noqa: E402
from lanes.core.sampling import SamplingParams  # noqa: E402
from lanes.core.stream import Request  # noqa: E402
from lanes.gpu.device import choose, runner_for  # noqa: E402
from lanes.grammar import engine as grammars  # noqa: E402
from lanes.loader import load_model  # noqa: E402

SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=4096)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, tie_word_embeddings=True, max_position_embeddings=1024)


class WaitedGrammars(LaneGrammars):
    """LaneGrammars whose mask futures add up how long the sampler waited on them after the forward."""

    waited = 0.0

    def masks_beside(self, work):
        future = super().masks_beside(work)
        if future is None:
            return None
        outer = self

        class Timed:
            def result(self):
                began = time.perf_counter()
                try:
                    return future.result()
                finally:
                    type(outer).waited += time.perf_counter() - began

        return Timed()


def build(folder: Path, tokenizer: Path, device: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = len(json.loads(tokenizer.read_text())["model"]["vocab"])
    torch.manual_seed(0)
    shape = SHAPE if device == "cuda" else SMALL
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, vocab_size=vocab + 64)).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer.read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))


async def run(model, placement, engine, streams: int, new: int, constrained: bool, seed: int):
    backend = TorchBackend(model, runner_for(placement), lanes=streams, max_model_len=512, grammars=engine.matcher)
    backend.grammars = WaitedGrammars(model.config.vocab_size, engine.matcher)
    WaitedGrammars.waited = 0.0
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(streams)]
    requests = []
    for i, name in enumerate(names):
        grammar = engine.check(grammars.json_schema(SCHEMAS[name]), "json_schema") if constrained else None
        prompt = model.tokenizer.encode(PROMPTS[name])
        requests.append(Request(tuple(prompt), SamplingParams(temperature=0.7, seed=seed + i, max_tokens=new,
                                                              ignore_eos=not constrained, grammar=grammar)))
    async with running(backend, text=text_factory(model.tokenizer), stop_ids={0}, max_rows=4096, bound=float("inf")) as core:
        began = time.perf_counter()
        streams_ = [await core.submit(r) for r in requests]
        for s in streams_:
            await collect(s)
        wall = time.perf_counter() - began
        passes = core.statistics().passes
    return wall / max(passes, 1), WaitedGrammars.waited / max(passes, 1)


async def main(args) -> None:
    folder = Path(tempfile.mkdtemp())
    print("building the model ...", file=sys.stderr, flush=True)
    build(folder, Path(args.tokenizer), args.device)
    placement = choose(args.device, "bf16" if args.device == "cuda" else "fp32")
    model = load_model(folder, placement, kv_blocks=args.streams * blocks_for(512) + 16, quiet=True)
    engine = grammars.GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, [0])  # ends: unused (ignore_eos)
    engine.warm()
    times = {True: [], False: []}
    waits = []
    for round_ in range(2):
        for constrained in (False, True):
            per_pass, waited = await run(model, placement, engine, args.streams, args.new, constrained, 100 * round_)
            times[constrained].append(per_pass)
            if constrained:
                waits.append(waited)
    plain, held = statistics.mean(times[False]), statistics.mean(times[True])
    wait = statistics.mean(waits)
    print(f"{args.streams} streams, {args.new} tokens, vocabulary {model.config.vocab_size}, {args.device}")
    print(f"{'':24}{'ms a pass':>10}{'of unconstrained':>18}")
    print(f"{'unconstrained':24}{plain * 1e3:>10.2f}{1.0:>18.3f}")
    print(f"{'constrained':24}{held * 1e3:>10.2f}{held / plain:>18.3f}")
    print(f"{'  waited on masks':24}{wait * 1e3:>10.2f}{wait / plain:>18.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    trio.run(main, parser.parse_args())
