"""A request's sampling parameters, with OpenAI's names and ranges (and vLLM's extras), and one logits row's
share of a pass. Plain data: the draws themselves are the backend's (lanes.backend.draws)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .grammar import Grammar


MAX_TOP_LOGPROBS = 20
MAX_STOPS = 4
MAX_LOGIT_BIAS = 300  # tokens a request may bias, as OpenAI's API allows


class InvalidParameter(ValueError):
    """A sampling parameter outside its range: `param` names it, the message is one sentence."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, with OpenAI's names and ranges (and vLLM's extras)."""

    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # None: the engine draws one per request (`with_seed`)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = None  # None: up to the model's length; 0: the prompt alone (its logprobs), no draw
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20
    prompt_logprobs: bool = False  # logprobs of every prompt token (completions with echo)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit before anything else)
    min_tokens: int = 0  # tokens out before a stop token or a stop string may end the stream
    min_tokens_stops: tuple[int, ...] = ()  # masked until then: the stream's stop tokens (the lane core fills it in)
    include_stop_str_in_output: bool = False  # the stop string (or a stop token's text) ends the text, not cut
    skip_special_tokens: bool = True  # special tokens give no text
    grammar: Grammar | None = None  # the tokens must match it: each draw is masked to what it allows next

    def validate(self) -> None:
        """Raises InvalidParameter for the first parameter outside its range (NaN is outside every range)."""
        checks = (
            ("temperature", 0 <= self.temperature <= 2, "temperature must be between 0 and 2"),
            ("top_p", 0 < self.top_p <= 1, "top_p must be greater than 0 and at most 1"),
            ("top_k", self.top_k >= 0, "top_k must be 0 (off) or a positive integer"),
            ("min_p", 0 <= self.min_p <= 1, "min_p must be between 0 and 1"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "presence_penalty must be between -2 and 2"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2"),
            ("repetition_penalty", self.repetition_penalty > 0, "repetition_penalty must be greater than 0"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "max_tokens must not be negative"),
            ("min_tokens", self.min_tokens >= 0, "min_tokens must not be negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens must be at most max_tokens"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias may hold at most 300 tokens"),
            ("logit_bias", all(-100 <= bias <= 100 for _, bias in self.logit_bias),
             "logit_bias values must be between -100 and 100"),
            ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs must be between 0 and 20"),
            ("top_logprobs", self.logprobs or self.top_logprobs == 0, "top_logprobs requires logprobs to be true"),
            ("stop", len(self.stop) <= MAX_STOPS, "stop may hold at most 4 strings"),
            ("stop", all(self.stop), "stop strings must not be empty"),
            # a finished grammar allows only the end tokens: they must end the stream, and may come at once
            ("ignore_eos", self.grammar is None or not self.ignore_eos, "ignore_eos cannot be used with a grammar"),
            ("min_tokens", self.grammar is None or not self.min_tokens, "min_tokens cannot be used with a grammar"),
        )
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameter(param, message)

    def check_ids(self, vocab_size: int) -> None:
        """Raises InvalidParameter for a token id the model's logits do not have (in logit_bias, stop_token_ids)."""
        biased = [token for token, _ in self.logit_bias]
        for param, ids in (("logit_bias", biased), ("stop_token_ids", self.stop_token_ids)):
            if not all(0 <= token < vocab_size for token in ids):
                raise InvalidParameter(param, f"{param} token ids must be between 0 and {vocab_size - 1}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def with_seed(self, seed: int) -> SamplingParams:
        return dataclasses.replace(self, seed=seed)

    @property
    def needs_penalties(self) -> bool:
        """Whether the sampler reads this request's token history (its lane must be bound in PenaltyState)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @cached_property  # read for every row of every pass
    def plain(self) -> bool:
        """A draw that is the raw logits' argmax, reporting at most its logprob (`plain_greedy`): no penalty,
        no bias, no min_tokens mask and no grammar changes the logits."""
        return (self.greedy and not self.needs_penalties and self.top_logprobs == 0 and not self.logit_bias
                and not self.min_tokens and self.grammar is None)


@dataclass(frozen=True, init=False)
class RowSampling:
    """One logits row of a pass: its lane, its request's parameters, and how many tokens the stream has
    produced before this one (with the seed, `step` fixes the draw whatever else is in the batch)."""

    lane: int
    params: SamplingParams
    step: int

    def __init__(self, lane: int, params: SamplingParams, step: int) -> None:
        # One a row a pass: the instance dict filled at once, not through object.__setattr__ a field.
        fields = self.__dict__
        fields["lane"], fields["params"], fields["step"] = lane, params, step


def plain_greedy(rows: Sequence[RowSampling]) -> bool:
    """Rows whose draw is the argmax of the raw logits and that report at most its logprob: `greedy_draw`
    gives exactly what `sample` would, so it can run inside a captured graph."""
    return all(r.params.plain for r in rows)
