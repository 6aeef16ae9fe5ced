"""The grammar engine: llguidance over the model's own tokenizer. Grammars are checked here when a request
comes (refused by the keyword llguidance cannot enforce), and a bound lane's matcher is built from one.

docs/DECISIONS.md says why llguidance: it reads tokenizer.json as it is, compiles in about a millisecond,
releases the GIL while it computes a mask, rolls back, and refuses what it cannot enforce.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable

import llguidance as llg
import numpy as np

from ..core.grammar import Grammar, words

# One separator spelling and no free whitespace: a constrained JSON run cannot loop on blanks, and its text
# is json.dumps' (and chat templates' tojson) spelling, which models have seen most.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"[^\]]*\]')


class GrammarRefused(ValueError):
    """A grammar the engine cannot enforce or parse: `keyword` names the schema keyword at fault, if one is."""

    def __init__(self, message: str, keyword: str | None = None) -> None:
        super().__init__(message)
        self.message, self.keyword = message, keyword


def json_schema(schema: Any, lenient: bool = False) -> str:
    """llguidance's grammar for a JSON schema (a dict, or True for any JSON value)."""
    return llg.LLMatcher.grammar_from_json_schema(bounded(schema), overrides={**JSON_OPTIONS, "lenient": lenient})


SAFE_INTEGERS = (-(2**53 - 1), 2**53 - 1)  # JSON's interoperable integers (RFC 8259 section 6)
DATA = {"enum", "const", "default", "examples"}  # keywords whose values are instances, not schemas


def bounded(schema: Any) -> Any:
    """The schema with integers that have no bound held to JSON's interoperable range (+-(2**53 - 1)): a
    greedy run cannot write digits without end (larger integers are refused; every value it allows is one the schema allows)."""
    if isinstance(schema, list):
        return [bounded(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in DATA else bounded(value) for key, value in schema.items()}
    kinds = schema.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and kinds == ["integer"]):
        if "minimum" not in schema and "exclusiveMinimum" not in schema:
            out["minimum"] = SAFE_INTEGERS[0]
        if "maximum" not in schema and "exclusiveMaximum" not in schema:
            out["maximum"] = SAFE_INTEGERS[1]
    return out


def json_rule(schema: Any, lenient: bool = False) -> str:
    """A schema as a rule inside a Lark grammar, with the same options as `json_schema`."""
    schema = bounded(schema)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS, "lenient": lenient}}
    else:
        schema = {"anyOf": [{}] if schema is True else [schema], "x-guidance": {**JSON_OPTIONS, "lenient": lenient}}
    return "%json " + json.dumps(schema)


def regex(pattern: str) -> str:
    return llg.LLMatcher.grammar_from_regex(pattern)


def lark(source: str) -> str:
    return llg.LLMatcher.grammar_from_lark(source)


def choice(options: Iterable[str]) -> str:
    """Exactly one of `options`, as text."""
    return lark("start: " + " | ".join(json.dumps(option) for option in options))


class LlgMatcher:
    """`lanes.core.grammar.Matcher` over an `llguidance.LLMatcher`; a matcher in error allows only the end tokens."""

    __slots__ = ("_matcher", "_ends")

    def __init__(self, matcher: llg.LLMatcher, ends: np.ndarray) -> None:
        self._matcher, self._ends = matcher, ends

    def fill(self, mask: np.ndarray) -> None:
        if self._matcher.is_error():
            mask[:] = self._ends
            return
        self._matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)  # releases the GIL

    def consume(self, tokens) -> bool:
        return self._matcher.consume_tokens(list(tokens))

    def validate(self, tokens) -> int:
        return self._matcher.validate_tokens(list(tokens))

    def rollback(self, count: int) -> None:
        self._matcher.rollback(count)


class GrammarEngine:
    """llguidance for one model: its tokenizer (built once, ~0.5 s for 49k tokens, on first use or `warm`),
    grammar checks, and matchers. Thread-safe: checks run in worker threads, matchers in the pass's.

    A check compiles the grammar into a pristine matcher, kept (the newest `kept` sources), so a lane's
    matcher is a copy (microseconds on the pass's thread, not a compile) and a repeated schema compiles once."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_ids: Iterable[int], kept: int = 256) -> None:
        self._json, self.vocab_size = tokenizer_json, vocab_size
        self.end_ids = tuple(sorted(set(end_ids)))
        self._tokenizer: llg.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, llg.LLMatcher] = OrderedDict()  # pristine: only ever copied
        self._kept = kept
        self._ends = np.zeros(words(vocab_size), dtype=np.int32)
        for token in self.end_ids:
            self._ends.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, end_ids: Iterable[int]) -> GrammarEngine:
        return cls(tokenizer.to_json(), vocab_size, end_ids)

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg.LLTokenizer(self._json, n_vocab=self.vocab_size, eos_token=list(self.end_ids))
            return self._tokenizer

    def warm(self) -> None:
        self.tokenizer  # noqa: B018 (built now rather than at the first constrained request)

    def check(self, source: str, what: str) -> Grammar:
        """The grammar, once llguidance has compiled it against this tokenizer; raises GrammarRefused."""
        self._pristine(source)
        return Grammar(source, what)

    def matcher(self, grammar: Grammar) -> LlgMatcher:
        return LlgMatcher(self._pristine(grammar.source).deep_copy(), self._ends)

    def _pristine(self, source: str) -> llg.LLMatcher:
        with self._lock:
            found = self._compiled.get(source)
            if found is not None:
                self._compiled.move_to_end(source)
                return found
        matcher = llg.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            message = matcher.get_error() or "the grammar is invalid"
            found = UNIMPLEMENTED.search(message)  # the keywords alone, not the grammar around them
            raise GrammarRefused(found.group(0) if found else " ".join(message.split()), keyword(message))
        with self._lock:
            self._compiled[source] = matcher
            while len(self._compiled) > self._kept:
                self._compiled.popitem(last=False)
        return matcher

    def special(self, text: str) -> bool:
        """Whether `text` is one token that the tokenizer marks special (a grammar names such by token)."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return len(ids) == 1 and self.tokenizer.is_special_token(ids[0])


def keyword(message: str) -> str | None:
    """The schema keyword an llguidance refusal names, if it names one."""
    found = UNIMPLEMENTED.search(message)
    if found:
        return found.group(1)
    if message.startswith("Unknown format"):
        return "format"
    if "regex parse error" in message:
        return "pattern"
    return None
