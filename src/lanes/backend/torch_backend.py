"""The backend a loaded family gives the lane core: one forward over every lane's rows, sampling on the
device, and one host read-back a pass; run through the device's runner so the event loop never blocks.

On CUDA with captured graphs its shape `feeds`: a fed decode pass is queued behind the running one and
reads its tokens from that one's draws on the device, and plain greedy passes read back into page-locked
buffers, so a pass's result is waited for on its own event while the pass behind it runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch

from ..core.backend import BackendShape
from ..core.grammar import Grammar, LaneGrammars, Matcher
from ..core.plan import LabelRead, PassResult, Plan, Sampled, TargetLogprobs, accepted
from ..core.sampling import RowSampling, SamplingParams
from ..core.stops import TextAssembler
from ..gpu.device import CpuRunner, CudaRunner
from ..gpu.graphs import PROMPT_ROWS, DecodeGraphs, graphs_enabled, greedy_draw
from ..gpu.transfer import PinnedRing, to_host
from ..loader import LoadedModel
from ..text.tokenizer import Tokenizer
from .draws import Sampled as SampledTensors
from .draws import on_host, prompt_logprobs, sample
from .penalties import PenaltyState
from .vision_lanes import VisionLanes


class TorchBackend:
    """A `LoadedModel`'s decoder driven by plans. `lanes` and `max_model_len` bound what the lane core plans."""

    def __init__(self, model: LoadedModel, runner: CpuRunner | CudaRunner, *, lanes: int, max_model_len: int | None = None,
                 graphs: bool = True, capture: bool = True, grammars: Callable[[Grammar], Matcher] | None = None) -> None:
        self.model = model
        self.decoder = model.decoder
        self.runner = runner
        length = min(max_model_len or model.config.max_position, model.config.max_position)
        kv = model.decoder.kv
        self._shape = BackendShape(lanes, model.kv_blocks, kv.shape.block_size, model.config.vocab_size, length,
                                   bytes_per_block=kv.shape.bytes_per_block(kv.data.dtype))
        self.penalties = PenaltyState(lanes, model.config.vocab_size, model.placement.device)
        self.grammars = LaneGrammars(model.config.vocab_size, grammars)  # matchers from `grammars`, if given
        self.graphs = fast_decode(model, lanes, length, graphs)
        tower = model.vision
        self.vision = VisionLanes(tower, tower.config.merge_size, model.placement.device) if tower is not None else None
        if self.graphs is not None and capture:
            with torch.cuda.stream(runner.torch_stream):
                self.graphs.capture()
        feeds = self.graphs is not None and self.graphs.feeds and model.decoder.shard.world == 1
        self._shape = replace(self._shape, feeds=feeds)
        # Two passes in flight at most (the one waited for, the one queued behind it); two spare.
        self._pinned = PinnedRing(4, 2 * lanes) if model.placement.is_cuda else None
        self._queued: tuple[Plan, _Pending] | None = None  # a pass queued behind the last one stepped
        self._last_rows: dict[int, int] = {}  # lane -> row of the last fast decode pass launched

    @property
    def shape(self) -> BackendShape:
        return self._shape

    def bind(self, lane: int, prompt: Sequence[int], sampling: SamplingParams, media: Sequence = ()) -> None:
        if sampling.needs_penalties:
            self.penalties.bind(lane, prompt)
        if sampling.grammar is not None:
            self.grammars.bind(lane, sampling.grammar)
        if media:
            if self.vision is None:
                raise ValueError("this model has no vision tower loaded")  # the server refuses such requests before
            self.vision.bind(lane, len(prompt), media)

    def unbind(self, lane: int) -> None:
        if self.penalties.is_bound(lane):
            self.penalties.unbind(lane)
        if self.grammars.is_bound(lane):
            self.grammars.unbind(lane)
        if self.vision is not None:
            self.vision.unbind(lane)

    async def aclose(self) -> None:
        self.grammars.close()
        self.runner.close()

    async def step(self, plan: Plan, started: Callable[[], None] | None = None,
                   following: Plan | None = None) -> PassResult:
        launch = lambda: self._launch_step(plan, following)  # noqa: E731
        if self._replays(plan):  # a replay is cheap to launch: from the event loop, and polled there
            return await self.runner.run_inline(launch, started)
        return await self.runner.run_launched(launch, started)

    def _replays(self, plan: Plan) -> bool:
        """Whether the pass is a captured graph's replay (or is queued already)."""
        if self.graphs is None or not self.graphs.feeds:
            return False
        queued = self._queued
        return (queued is not None and queued[0] is plan) or fast_step(self.graphs, plan, self.vision)

    def _launch_step(self, plan: Plan, following: Plan | None) -> "_Pending":
        queued, self._queued = self._queued, None
        if queued is not None and queued[0] is not plan:
            queued[1].result()  # queued by a lane core that stopped before stepping it: it ran void
            queued = None
        pending = queued[1] if queued is not None else self.launch(plan)
        if following is not None:
            self._queued = following, self.launch(following)
        return pending

    @torch.inference_mode()
    def launch(self, plan: Plan) -> "_Pending":
        """Put the pass on the current stream: forward, sample, and the read-back of its results."""
        if plan.fed and not self._shape.feeds:
            raise ValueError("this backend cannot run fed plans")
        self.penalties.flush()  # the lanes bound and freed since the last pass, written on this pass's stream
        feed = [self._last_rows[p.lane] for p in plan.pieces] if plan.fed else None
        masks = None if plan.plain else self.grammars.masks_beside(plan.work)  # on the host while the forward runs
        logits, greedy = forward(self.decoder, self.graphs, plan, self.vision, feed)
        if greedy is not None:  # the draws buffer holds a row for each piece whose logits are read
            read = plan.pieces if plan.fed else [p for p in plan.pieces if p.logits == "last"]
            self._last_rows = {p.lane: row for row, p in enumerate(read)}
        if plan.plain:  # the planner's choice: every row a plain greedy draw
            return self._greedy_result(plan, greedy if greedy is not None else greedy_draw(logits))
        return _Pending(self._general_result(plan, logits, masks))

    def _general_result(self, plan: Plan, logits: torch.Tensor, masks=None) -> Callable[[], PassResult]:
        """Queue the pass's sampling and reads on the device; returns what reads them back (one sync)."""
        device = logits.device
        draw_rows, rows, target_rows, targets, read_rows, labels = [], [], [], [], [], []
        before, drafts = [], []  # each draw's tokens ahead of it in its draft; (first draw, draft) a drafted work
        offset = 0
        for work in plan.work:
            n = work.piece.logit_rows
            if work.draft:  # a draw at every row of the piece, each keyed by its own step
                sample = work.sample
                drafts.append((len(rows), work.draft))
                draw_rows.extend(range(offset, offset + n))
                rows.extend(RowSampling(sample.lane, sample.params, sample.step + i) for i in range(n))
                before.extend(work.draft[:i] for i in range(n))
            elif work.sample is not None:
                draw_rows.append(offset + n - 1)
                rows.append(work.sample)
                before.append(())
            if work.labels:
                read_rows.extend([offset + n - 1] * len(work.labels))
                labels.extend(work.labels)
            target_rows.extend(range(offset, offset + len(work.targets)))
            targets.extend(work.targets)
            offset += n
        on_device = []
        if rows:
            drawn = self._draw(logits, draw_rows, rows, device, before if drafts else None, drafts,
                               masks.result() if masks is not None else None)
            on_device += [drawn.tokens, drawn.logprobs, drawn.top_ids, drawn.top_logprobs]
        if targets:
            index = torch.tensor(target_rows, dtype=torch.int64, device=device)
            top = max(w.top for w in plan.work)
            on_device += prompt_logprobs(logits.index_select(0, index), torch.tensor(targets, device=device), top)
        if labels:
            on_device += self._label_reads(logits, read_rows, labels, device)
        return lambda: self._general_read(plan, rows, bool(targets), bool(labels), to_host(on_device))  # one sync

    def _general_read(self, plan: Plan, rows: list[RowSampling], targets: bool, labels: bool,
                      host: list[torch.Tensor]) -> PassResult:
        drawn_host = on_host(SampledTensors(*host[:4]), rows) if rows else None
        at = 4 if rows else 0
        prompt = self._prompt_results(plan, host[at : at + 3]) if targets else [None] * len(plan.work)
        reads = self._reads(plan, host[-2:]) if labels else []
        sampled, i = [], 0
        for work in plan.work:
            if work.sample is None:
                sampled.append(None)
                continue
            n = len(work.piece.tokens) if work.draft else 1
            kept = accepted(work.draft, drawn_host.tokens[i : i + n]) if work.draft else 1
            wants = work.sample.params.logprobs
            sampled.append(Sampled(tuple(drawn_host.tokens[i : i + kept]),
                                   tuple(drawn_host.logprobs[i : i + kept]) if wants else (None,) * kept,
                                   tuple(tuple(top) for top in drawn_host.top[i : i + kept])))
            i += n
        self.grammars.advance(plan.work, sampled)  # each constrained lane's matcher takes what its lane kept
        return PassResult(tuple(sampled), tuple(prompt), tuple(reads))

    def _greedy_result(self, plan: Plan, drawn: torch.Tensor) -> "_Pending":
        """A pass whose every row is plain greedy, from its draws [2, R] float64: one small read-back, on
        CUDA into a page-locked buffer behind which the pass's own event is recorded."""
        rows = drawn.shape[1]
        if self._pinned is None:
            return _Pending(lambda: _greedy_sampled(plan, drawn.reshape(-1).numpy()))
        host = self._pinned.take()[: 2 * rows]
        host.copy_(drawn.reshape(-1), non_blocking=True)
        return _Pending(lambda: _greedy_sampled(plan, host.numpy()), self.runner.record())

    @staticmethod
    def _label_reads(logits, read_rows, labels, device) -> list[torch.Tensor]:
        """Each read's label logprobs (logit less the row's logsumexp) and whether the row's argmax is a label."""
        rows = torch.tensor(read_rows, dtype=torch.int64, device=device)
        ids = torch.tensor(labels, dtype=torch.int64, device=device)
        picked = logits.index_select(0, rows).float()  # [L, V]: the row of each label, repeated
        values = picked.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(picked, dim=-1)  # [L] float32
        is_argmax = (picked.argmax(dim=-1) == ids).to(torch.int64)  # [L]: this label is the row's argmax
        return [values, is_argmax]

    @staticmethod
    def _reads(plan: Plan, host: list[torch.Tensor]) -> list[LabelRead | None]:
        values, is_argmax = host[0].tolist(), host[1].tolist()
        out, at = [], 0
        for work in plan.work:
            n = len(work.labels)
            out.append(LabelRead(tuple(values[at : at + n]), any(is_argmax[at : at + n])) if n else None)
            at += n
        return out

    def _draw(self, logits: torch.Tensor, draw_rows: list[int], rows: list[RowSampling], device,
              before=None, drafts=(), masks=None) -> SampledTensors:
        """The rows' draws; each drafted row counts the draft tokens ahead of it among its lane's output, and
        only a draft's accepted draws are recorded in its lane's history (decided on the device)."""
        picked = logits.index_select(0, torch.tensor(draw_rows, dtype=torch.int64, device=device))  # [S, V]
        penalised = any(r.params.needs_penalties for r in rows)
        out = sample(picked, rows, self.penalties if penalised else None, before, masks)
        if penalised:
            lanes = torch.tensor([r.lane for r in rows], dtype=torch.int64, device=device)
            kept = torch.ones(len(rows), dtype=torch.bool, device=device)  # [S]
            for first, draft in drafts:
                k = len(draft)
                agree = out.tokens[first : first + k] == torch.tensor(draft, dtype=torch.int64, device=device)
                kept[first + 1 : first + 1 + k] = torch.cumprod(agree.to(torch.int64), 0).bool()
            self.penalties.record(lanes[kept], out.tokens[kept])
        return out

    @staticmethod
    def _prompt_results(plan: Plan, host: list[torch.Tensor]) -> list[TargetLogprobs | None]:
        values, ids, top_values = (t.tolist() for t in host)
        out, at = [], 0
        for work in plan.work:
            n = len(work.targets)
            if not n:
                out.append(None)
                continue
            alternatives = tuple(tuple(zip(ids[at + j][: work.top], top_values[at + j][: work.top])) for j in range(n))
            out.append(TargetLogprobs(tuple(values[at : at + n]), alternatives))
            at += n
        return out


class _Pending:
    """A launched pass: `result()` waits for its event (if any; else the read blocks) and reads it back.
    With an event (`waits`), its end can also be polled (`done`) and waited for (`wait`) before `read`."""

    def __init__(self, read: Callable[[], PassResult], event=None) -> None:
        self._read, self._event = read, event
        self.waits = event is not None

    def done(self) -> bool:
        return self._event.is_done

    def wait(self) -> None:
        self._event.sync()  # this thread sleeps (or spins) until the GPU has reached the pass's end

    @torch.inference_mode()
    def read(self) -> PassResult:
        if self._event is not None:
            self._event.close()
            self._event = None
        return self._read()

    def result(self) -> PassResult:
        if self._event is not None:
            self.wait()
        return self.read()


_NO_TOP = ((),)


def _greedy_sampled(plan: Plan, drawn: np.ndarray) -> PassResult:
    """`drawn`: a pass's greedy draws [2, R] float64, flat (ids are exact in float64)."""
    rows = len(plan.work)
    tokens, logprobs = drawn[:rows].astype(np.int64).tolist(), drawn[rows : 2 * rows].tolist()
    sampled = tuple(Sampled((t,), (lp if w.sample.params.logprobs else None,), _NO_TOP)
                    for w, t, lp in zip(plan.work, tokens, logprobs))
    return PassResult(sampled, (None,) * rows)


def fast_decode(model: LoadedModel, lanes: int, length: int, wanted: bool) -> DecodeGraphs | None:
    """The fast decode step's buffers (captured later, or not), where the device has it."""
    if not graphs_enabled(model.placement.device, wanted):
        return None
    # Tensor-parallel ranks run uncaptured, on exactly the general forward's shapes: decode rows only.
    return DecodeGraphs(model.decoder, lanes, length, PROMPT_ROWS if model.decoder.shard.world == 1 else 0)


def forward(decoder, fast: DecodeGraphs | None, plan: Plan, vision: VisionLanes | None = None,
            feed: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pass's logits [R, V] (each piece's asked-for rows, in order) and, where a captured graph computed
    them, every row's greedy draw [2, R]: the fast step when the pass fits it (decode rows, and short
    prompts without media), else the general forward.

    Tensor-parallel followers call this too, so every rank takes the same path with the same collectives."""
    pieces = plan.pieces
    if plan.fed and feed is None:
        raise ValueError(f"pass {plan.step} is fed: its tokens are on the device, in the draws of the pass before")
    if fast_step(fast, plan, vision):
        return fast.run(pieces, vision.offsets(pieces) if vision is not None else None, feed)
    return decoder.forward(pieces, vision.pass_media(pieces) if vision is not None else None), None


def fast_step(fast: DecodeGraphs | None, plan: Plan, vision: VisionLanes | None) -> bool:
    """Whether `forward` runs the pass as the fast step: it fits (decode rows, short prompts) and no prompt
    in it has media. A fed plan is decode rows, so it always fits."""
    if fast is None:
        return False
    pieces = plan.pieces
    if vision is not None and any(vision.bound(p.lane) for p in pieces[: plan.prefills]):
        return False
    return plan.fed or fast.fits(pieces)


def text_factory(tokenizer: Tokenizer):
    """Per stream: whole characters from its tokens, cut at its stop strings."""

    def make(prompt: Sequence[int], sampling: SamplingParams) -> TextAssembler:
        detokenizer = tokenizer.detokenizer(prompt, skip_special_tokens=sampling.skip_special_tokens)
        return TextAssembler(detokenizer, sampling.stop, min_tokens=sampling.min_tokens,
                             include_stop=sampling.include_stop_str_in_output)

    return make
