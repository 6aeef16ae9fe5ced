"""Grammars on the default model, on the CPU: how long a schema takes to be ready (checked, compiled, a
matcher built), what share of a 32-stream decode pass the masks take, and constrained generations over
real-world schemas checked by a strict JSON parser and `jsonschema`, with how many end on `length`.

`python bench/grammar.py [--generations N] [--tiny qwen2|llama|qwen3]`. Figures on a shared 2-core machine are indicative.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from engine_helpers import collect, running  # noqa: E402
from lanes.backend.torch_backend import TorchBackend, text_factory  # noqa: E402
from lanes.core.grammar import LaneGrammars  # noqa: E402
from lanes.core.sampling import SamplingParams  # noqa: E402
from lanes.core.stream import Request  # noqa: E402
from lanes.gpu.device import CpuRunner, choose  # noqa: E402
from lanes.grammar import engine as grammars  # noqa: E402
from lanes.loader import load_model  # noqa: E402
from lanes.models import resolve_model  # noqa: E402
from test_grammar_torch import strict_json  # noqa: E402

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
               "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "status": {"enum": ["new", "paid", "shipped"]}, "note": {"type": "string", "maxLength": 30}},
        "required": ["id", "items", "status"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "location": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                      "country": {"type": "string", "maxLength": 20}},
                     "required": ["city"], "additionalProperties": False},
        "online": {"type": "boolean"}}, "required": ["title", "date", "online"], "additionalProperties": False},
    "rating": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 5},
                                                "label": {"enum": ["bad", "ok", "good"]},
                                                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                         "maxItems": 3}},
               "required": ["score", "label"], "additionalProperties": False},
}
PROMPTS = {"person": "Describe a person as JSON.", "order": "Write a shop order as JSON.",
           "event": "Describe a meeting as JSON.", "rating": "Rate a film as JSON."}


def ready_times(engine, rounds: int, cold: bool) -> list[float]:
    """Check plus a matcher built; `cold` gives each round's schemas a new description, so each compiles."""
    times = []
    for round_ in range(rounds):
        for schema in SCHEMAS.values():
            source = grammars.json_schema({**schema, "description": f"round {round_}"} if cold else schema)
            start = time.perf_counter()
            engine.matcher(engine.check(source, "json_schema"))
            times.append(time.perf_counter() - start)
    return times


class TimedGrammars(LaneGrammars):
    """LaneGrammars that add up the time their masks took (computed beside the forward, so this is an upper bound)."""

    spent = 0.0

    def masks(self, work):
        start = time.perf_counter()
        try:
            return super().masks(work)
        finally:
            TimedGrammars.spent += time.perf_counter() - start


async def run(model, engine, requests, lanes: int):
    backend = TorchBackend(model, CpuRunner(), lanes=lanes, max_model_len=1024, grammars=engine.matcher)
    backend.grammars = TimedGrammars(model.config.vocab_size, engine.matcher)
    stops = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    TimedGrammars.spent = 0.0
    start = time.perf_counter()
    async with running(backend, text=text_factory(model.tokenizer), stop_ids=stops, max_rows=1024, bound=float("inf")) as core:
        streams = [await core.submit(r) for r in requests]
        outcomes = [await collect(s) for s in streams]
        passes = core.statistics().passes
    return outcomes, time.perf_counter() - start, TimedGrammars.spent, passes


def requests_for(model, names, constrained: bool, engine, max_tokens: int, seed: int):
    tokenizer = model.tokenizer
    out = []
    for i, name in enumerate(names):
        grammar = engine.check(grammars.json_schema(SCHEMAS[name]), "json_schema") if constrained else None
        prompt = tokenizer.encode_prompt(tokenizer.render_chat([{"role": "user", "content": PROMPTS[name]}]))
        out.append(Request(tuple(prompt), SamplingParams(temperature=0.7, top_p=0.95, seed=seed + i,
                                                         max_tokens=max_tokens, grammar=grammar,
                                                         ignore_eos=not constrained)))
    return out


async def main(generations: int, tiny_kind: str | None) -> None:
    if tiny_kind is None:
        model = load_model(resolve_model(None), choose("cpu", "fp32"), kv_blocks=32 * 64 + 64, quiet=True)
    else:
        import tempfile

        import tiny

        folder = Path(tempfile.mkdtemp())
        tiny.build(tiny_kind, folder, max_position_embeddings=1024)
        model = load_model(folder, choose("cpu", "fp32"), kv_blocks=32 * 64 + 64, quiet=True)
    print(f"model: {tiny_kind and f'tiny random {tiny_kind}' or 'the default model'}")
    stops = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    engine = grammars.GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, stops)
    engine.warm()
    for cold in (True, False):
        ready = sorted(ready_times(engine, 50, cold))
        print(f"grammar ready ({'compiled' if cold else 'kept'}): p50 {statistics.median(ready) * 1e3:.2f} ms, "
              f"p99 {ready[int(len(ready) * 0.99) - 1] * 1e3:.2f} ms over {len(ready)} requests of {len(SCHEMAS)} schemas")
    names = list(SCHEMAS) * 8  # 32 streams
    shares, walls = [], {True: [], False: []}
    for round_ in range(2):  # interleaved: constrained, unconstrained, constrained, unconstrained
        for constrained in (True, False):
            reqs = requests_for(model, names, constrained, engine, 24, 100 * round_)
            outcomes, wall, spent, passes = await run(model, engine, reqs, 32)
            walls[constrained].append(wall / max(passes, 1))
            if constrained:
                shares.append(spent / wall)
    print(f"32 streams, 24 tokens: a pass {statistics.median(walls[True]) * 1e3:.0f} ms constrained, "
          f"{statistics.median(walls[False]) * 1e3:.0f} ms not; masks {statistics.median(shares) * 100:.2f}% of the wall")
    import jsonschema  # the reference the generations are checked against (a test dependency)

    # A tiny model's tokens are bytes: an object of these schemas is up to ~4x as many tokens as with BPE.
    most = 256 if tiny_kind is None else 768

    done = parsed = cut = 0
    while done < generations:
        batch = names[: min(32, generations - done)]
        outcomes, _, _, _ = await run(model, engine, requests_for(model, batch, True, engine, most, 1000 + done), 32)
        for name, outcome in zip(batch, outcomes):
            if outcome.last.reason == "length":
                cut += 1
                continue
            jsonschema.validate(strict_json(outcome.text), SCHEMAS[name])
            parsed += 1
        done += len(batch)
    print(f"{done} constrained generations: {parsed} parsed and valid, {cut} ended on length ({100 * cut / done:.1f}%)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--generations", type=int, default=500)
    parser.add_argument("--tiny", default=None, help="a tiny random model of this family (tests/tiny.py) instead of the default")
    args = parser.parse_args()
    trio.run(main, args.generations, args.tiny)
