"""A deterministic toy backend (no torch) for exact scheduler tests and fuzzing.

It keeps a token in every KV slot a pass writes, and draws each next token from the whole context read
back through the lane's block table: a wrong block, position or order changes the output, so "concurrent
equals solo" is a real check of the lane core's bookkeeping.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import trio

from .backend import BackendShape
from .grammar import Grammar, LaneGrammars, allowed
from .plan import LabelRead, PassResult, Plan, Sampled, TargetLogprobs, accepted
from .sampling import SamplingParams
from .stops import StopStrings

EOS = 1


def _mix(*numbers: int) -> int:
    digest = hashlib.blake2b(repr(numbers).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class FakeBackend:
    """`pass_seconds` of (trio) time a pass; `fail_at` makes that pass number raise, to test a lost device.
    With `feeds`, a `fed` following pass runs when it is handed over (as a device queues it), reading the
    tokens its lanes drew in the pass before. Draws skip min_tokens' masked ids and those a lane's grammar
    refuses (`fake_grammar`); logit_bias has no logits to act on here and is not modelled."""

    lanes: int = 4
    blocks: int = 64
    vocab: int = 50
    max_model_len: int = 512
    pass_seconds: float = 0.0
    fail_at: int | None = None
    plans: list[Plan] = field(default_factory=list)
    bound: dict[int, tuple[int, ...]] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)
    block_size: int = 16
    feeds: bool = False
    _queued: tuple[Plan, PassResult] | None = None  # a following pass, run when handed over, not yet stepped

    def __post_init__(self) -> None:
        self.grammars = LaneGrammars(self.vocab, FakeMatcher.of)

    @property
    def shape(self) -> BackendShape:
        return BackendShape(self.lanes, self.blocks, self.block_size, self.vocab, self.max_model_len, feeds=self.feeds)

    def bind(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, media: Sequence = ()) -> None:
        if lane in self.bound:
            raise AssertionError(f"lane {lane} bound twice")
        self.bound[lane] = tuple(prompt)
        if sampling.grammar is not None:
            self.grammars.bind(lane, sampling.grammar)

    def unbind(self, lane: int) -> None:
        if self.bound.pop(lane, None) is None:
            raise AssertionError(f"lane {lane} unbound while free")
        if self.grammars.is_bound(lane):
            self.grammars.unbind(lane)

    async def aclose(self) -> None:
        self.bound.clear()

    async def step(self, plan: Plan, started: Callable[[], None] | None = None,
                   following: Plan | None = None) -> PassResult:
        queued, self._queued = self._queued, None
        if queued is not None and queued[0] is not plan:
            raise AssertionError(f"pass {queued[0].step} was queued behind the last, but pass {plan.step} came next")
        if queued is None:
            self.plans.append(plan)
        if plan.fed and queued is None:
            raise AssertionError(f"pass {plan.step} is fed but was not queued behind the pass it reads")
        if following is not None:
            if not (self.feeds and following.fed):
                raise AssertionError("a following pass needs a backend that feeds and a fed plan")
            result = queued[1] if queued is not None else self._run(plan)
            drawn = {w.piece.lane: s.token for w, s in zip(plan.work, result.sampled) if s is not None}
            self.plans.append(following)
            self._queued = following, self._run(following, drawn)
        if started is not None:
            started()
        if self.fail_at is not None and len(self.plans) == self.fail_at:
            raise RuntimeError("the fake device was lost")
        if self.pass_seconds:
            await trio.sleep(self.pass_seconds)
        else:
            await trio.lowlevel.checkpoint()
        if following is not None:
            return result
        return queued[1] if queued is not None else self._run(plan)

    def _run(self, plan: Plan, drawn: dict[int, int] | None = None) -> PassResult:
        """Write the plan's tokens into their slots and draw from each lane's context; a fed plan's tokens
        are `drawn`, by lane. A drafted piece draws at every row and keeps the prefix its draws confirm."""
        sampled, logprobs, reads = [], [], []
        masks = self.grammars.masks(plan.work)
        mask_of = dict(zip(masks.rows, masks.bits)) if masks is not None else {}
        drawn_row = 0  # the index of the work's first drawn row among the pass's drawn rows
        for work in plan.work:
            piece = work.piece
            tokens = (drawn[piece.lane],) if plan.fed else piece.tokens
            for offset, token in enumerate(tokens):
                self.slots[self._slot(piece.blocks, piece.start + offset)] = token
            context = [self.slots[self._slot(piece.blocks, p)] for p in range(piece.end)]
            if work.sample is None:
                sampled.append(None)
            elif work.draft:
                rows = [self._draw(context[: piece.start + i + 1], work, i, mask_of.get(drawn_row + i))
                        for i in range(len(piece.tokens))]
                kept = rows[: accepted(work.draft, [token for token, _, _ in rows])]
                sampled.append(Sampled(*(tuple(column) for column in zip(*kept))))
                drawn_row += len(piece.tokens)
            else:
                token, logprob, top = self._draw(context, work, 0, mask_of.get(drawn_row))
                sampled.append(Sampled((token,), (logprob,), (top,)))
                drawn_row += 1
            logprobs.append(self._target_logprobs(context, work) if work.targets else None)
            reads.append(self._read(context, work.labels) if work.labels else None)
        self.grammars.advance(plan.work, sampled)
        return PassResult(tuple(sampled), tuple(logprobs), tuple(reads))

    def _read(self, context: list[int], labels: tuple[int, ...]) -> LabelRead:
        """Label logprobs that depend on the whole context (like a model's), each below zero."""
        return LabelRead(tuple(-0.1 - (_mix(*context, label) % 1000) / 250 for label in labels), False)

    def _slot(self, blocks: Sequence[int], position: int) -> int:
        block = blocks[position // self.block_size]
        if not 0 <= block < self.blocks:
            raise AssertionError(f"block {block} is outside the pool")
        return block * self.block_size + position % self.block_size

    def _draw(self, context: list[int], work, row: int = 0, mask=None) -> tuple[int, float | None, tuple]:
        """The token a context draws (its `row`-th in the piece: the draw keyed by that step, under `mask`),
        its logprob and its top alternatives."""
        params, step = work.sample.params, work.sample.step + row
        salt = (0, 0) if params.greedy else (params.seed, step)
        token = _mix(*context, *salt) % self.vocab
        while step < params.min_tokens and token in params.min_tokens_stops:  # masked, as the sampler masks them
            token = (token + 1) % self.vocab
        if mask is not None:
            ok = allowed(mask, self.vocab)
            while not ok[token]:  # a grammar's mask: the next allowed token on
                token = (token + 1) % self.vocab
        top = tuple((t, -0.1 * (i + 1)) for i, t in enumerate(range(params.top_logprobs)))
        return token, -0.25 if params.logprobs else None, top

    def _target_logprobs(self, context: list[int], work) -> TargetLogprobs:
        start = work.piece.start
        values = tuple(-((_mix(*context[: start + i + 1], t) % 100) / 10) for i, t in enumerate(work.targets))
        top = tuple(tuple((k, -0.05 * (k + 1)) for k in range(work.top)) for _ in work.targets)
        return TargetLogprobs(values, top)


class FakeText:
    """Text for fake tokens ("t12 "), with stop strings held back (and held off for the first min_tokens
    tokens) as the real assembler does."""

    def __init__(self, stops: Sequence[str], min_tokens: int = 0, include_stop: bool = False) -> None:
        self.stops = StopStrings(stops, include_stop)
        self.stopped = False
        self.min_tokens = min_tokens
        self.pushed = 0

    def push(self, token: int) -> tuple[str, bool]:
        self.pushed += 1
        text, self.stopped = self.stops.push(f"t{token} ", self.pushed > self.min_tokens)
        return text, self.stopped

    def finish(self) -> str:
        return "" if self.stopped else self.stops.flush()


def fake_text(prompt: Sequence[int], sampling: SamplingParams) -> FakeText:
    return FakeText(sampling.stop, sampling.min_tokens, sampling.include_stop_str_in_output)


class FakeDrafter:
    """A draft source for the fake backend, which it knows: it proposes what the fake would draw, each token
    made wrong with probability `wrong` (seeded), so drafts come some right and some wrong (tests, fuzzer)."""

    def __init__(self, vocab: int, wrong: float = 0.3, seed: int = 0) -> None:
        self.vocab, self.wrong = vocab, wrong
        self._rng = random.Random(seed)

    def propose(self, job, most: int) -> tuple[int, ...]:
        params, step = job.sampling, len(job.generated)
        context = [*job.prompt, *job.generated]  # what the lane's KV holds once its pending token is written
        draft = []
        for i in range(most):
            salt = (0, 0) if params.greedy else (params.seed, step + i)
            token = _mix(*context, *salt) % self.vocab
            while step + i < params.min_tokens and token in params.min_tokens_stops:
                token = (token + 1) % self.vocab
            if self._rng.random() < self.wrong:
                token = (token + 1 + self._rng.randrange(self.vocab - 1)) % self.vocab
            draft.append(token)
            context.append(token)
        return tuple(draft)

    def forget(self, job) -> None:
        pass


def fake_grammar(modulus: int, residue: int, length: int) -> Grammar:
    """A toy grammar for the fake backend: `length` tokens each `residue` modulo `modulus`, then EOS."""
    return Grammar(f"fake {modulus} {residue} {length}", "fake")


class FakeMatcher:
    """`fake_grammar`'s matcher: the tokens it has taken, checked one by one."""

    def __init__(self, modulus: int, residue: int, length: int) -> None:
        self.modulus, self.residue, self.length = modulus, residue, length
        self.taken: list[int] = []
        self.broken = False

    @classmethod
    def of(cls, grammar: Grammar) -> "FakeMatcher":
        _, modulus, residue, length = grammar.source.split()
        return cls(int(modulus), int(residue), int(length))

    def _allows(self, at: int, token: int) -> bool:
        if at >= self.length:
            return token == EOS
        return token % self.modulus == self.residue and token != EOS

    def fill(self, mask) -> None:
        mask[:] = 0
        at = len(self.taken)
        for token in range(len(mask) * 32):
            if self.broken and token == EOS or not self.broken and self._allows(at, token):
                mask[token // 32] |= (1 << (token % 32)) - (1 << 32 if token % 32 == 31 else 0)

    def validate(self, tokens) -> int:
        n = 0
        while n < len(tokens) and not self.broken and self._allows(len(self.taken) + n, tokens[n]):
            n += 1
        return n

    def consume(self, tokens) -> bool:
        if self.validate(tokens) < len(tokens):
            self.broken = True
            return False
        self.taken.extend(tokens)
        return True

    def rollback(self, count: int) -> None:
        if count:
            del self.taken[-count:]
