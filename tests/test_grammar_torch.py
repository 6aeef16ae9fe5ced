"""Grammars on the torch backend: llguidance's masks applied before the draw, a tiny random model's output
held to JSON schemas (checked by a strict JSON parser and `jsonschema`), drafted rows masked by the state
after the draft before them, and the matchers bound and freed with their lanes.

Rules: a tiny transformers checkpoint built in the test, on the CPU; the real lane core; solo undrafted runs
are the reference for drafted ones; every test under `trio.fail_after` (engine_helpers.running).
"""

import json

import jsonschema
import pytest

import tiny
from engine_helpers import collect, running
from lanes.backend.torch_backend import TorchBackend, text_factory
from lanes.core.sampling import SamplingParams
from lanes.core.stream import Request
from lanes.gpu.device import CpuRunner, choose
from lanes.grammar import engine as grammars
from lanes.loader import load_model

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "kind": {"enum": ["book", "film", "song"]},
    "score": {"type": "integer", "minimum": -5, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["id", "kind", "score"], "additionalProperties": False}


def strict_json(text: str):
    """json.loads without NaN or Infinity, and no key twice."""
    def no_constants(name):
        raise ValueError(f"not JSON: {name}")

    def pairs(items):
        keys = [k for k, _ in items]
        assert len(keys) == len(set(keys)), keys
        return dict(items)

    return json.loads(text, parse_constant=no_constants, object_pairs_hook=pairs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2-grammar")
    tiny.build("qwen2", folder, max_position_embeddings=512)
    return load_model(folder, choose("cpu", "fp32"), kv_blocks=256, quiet=True)


def engine_for(model) -> grammars.GrammarEngine:
    ends = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    return grammars.GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, ends)


class ReplayDrafter:
    """Proposes the tokens a reference run produced after each stream's tokens so far, a share made wrong."""

    def __init__(self, reference: dict[tuple, list[int]], wrong_every: int = 0) -> None:
        self.reference, self.wrong_every = reference, wrong_every

    def propose(self, job, most):
        tokens = self.reference[job.prompt]
        at = len(job.generated)
        draft = list(tokens[at:at + most])
        if self.wrong_every and at % self.wrong_every == 0 and draft:
            draft[-1] = (draft[-1] + 7) % 200
        return tuple(draft)

    def forget(self, job) -> None:
        pass


async def generate(model, engine, requests, drafts=None):
    backend = TorchBackend(model, CpuRunner(), lanes=4, max_model_len=512, grammars=engine.matcher)
    stops = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    async with running(backend, text=text_factory(model.tokenizer), stop_ids=stops, drafts=drafts,
                       draft_tokens=4, draft_control=False) as core:
        streams = [await core.submit(r) for r in requests]
        outcomes = [await collect(s) for s in streams]
    backend.grammars.check_integrity()
    return outcomes


def requests(grammar, n: int = 6, max_tokens: int = 160) -> list[Request]:
    prompts = [tuple(range(10 + i, 20 + 2 * i)) for i in range(n)]
    return [Request(p, SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=max_tokens, grammar=grammar))
            for i, p in enumerate(prompts)]


async def test_a_tiny_random_model_writes_only_schema_valid_json(model):
    engine = engine_for(model)
    grammar = engine.check(grammars.json_schema(SCHEMA), "json_schema")
    outcomes = await generate(model, engine, requests(grammar))
    for outcome in outcomes:
        assert outcome.last.reason == "stop", outcome.text
        jsonschema.validate(strict_json(outcome.text), SCHEMA)
        assert outcome.tokens[-1] in model.tokenizer.eos_ids | set(model.config.eos_token_ids)


@pytest.mark.parametrize("wrong_every", [0, 3], ids=["right", "some-wrong"])
async def test_drafted_constrained_streams_equal_their_undrafted_runs(model, wrong_every):
    engine = engine_for(model)
    grammar = engine.check(grammars.json_schema(SCHEMA), "json_schema")
    batch = requests(grammar, n=4, max_tokens=60)
    solo = await generate(model, engine, batch)
    reference = {r.prompt: o.tokens for r, o in zip(batch, solo)}
    drafted = await generate(model, engine, batch, ReplayDrafter(reference, wrong_every))
    assert [o.tokens for o in drafted] == [o.tokens for o in solo]
    assert [o.text for o in drafted] == [o.text for o in solo]


def test_a_schema_keyword_the_engine_cannot_enforce_is_refused_by_name(model):
    engine = engine_for(model)
    for schema, word in (({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "not"),
                         ({"type": "string", "format": "no-such-format"}, "format"),
                         ({"type": "string", "pattern": "(?=a)b"}, "pattern")):
        with pytest.raises(grammars.GrammarRefused) as refused:
            engine.check(grammars.json_schema(schema), "json_schema")
        assert refused.value.keyword == word
