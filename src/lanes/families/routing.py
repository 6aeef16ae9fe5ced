"""Routers: which experts each token goes to, and with what weight, as the reference families choose them.

Every rank holds the whole router and routes the same tokens the same way, so routing needs no collective.
"""

from __future__ import annotations

import torch

from .config import MoEConfig
from .linear import Linear


class SoftmaxRouter:
    """Qwen2-MoE, Qwen3-MoE, Mixtral: a softmax over every expert's logit (in float32), the top k kept and,
    where the family says so, renormalised to sum to 1."""

    def __init__(self, gate: Linear, moe: MoEConfig) -> None:
        self.gate, self.top_k, self.normalize, self.fp32_weights = gate, moe.top_k, moe.normalize, moe.fp32_weights

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] -> (weights [T, k] in float32 or h's dtype, expert ids [T, k] int64)."""
        logits = self.gate(h)  # [T, experts], in the model's dtype as the reference computes them
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(h.dtype)), ids


class SigmoidGroupRouter:
    """GLM-4.5: each expert's sigmoid score in float32; experts are chosen by score plus a correction bias,
    only from the `top_groups` groups whose two best biased scores sum highest; the chosen experts' unbiased
    scores are the weights, renormalised where the family says so, then scaled."""

    def __init__(self, gate: Linear, bias: torch.Tensor, moe: MoEConfig) -> None:
        self.gate, self.bias, self.moe = gate, bias, moe  # gate and bias: float32, as the reference keeps them

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h: [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        moe = self.moe
        scores = torch.sigmoid(self.gate(h.float()))  # [T, experts] float32
        choice = scores + self.bias
        if moe.groups > 1:
            t = choice.shape[0]
            grouped = choice.view(t, moe.groups, moe.experts // moe.groups)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
            kept = torch.zeros_like(best).scatter_(1, best.topk(moe.top_groups, dim=-1)[1], 1.0)
            mask = kept.bool()[:, :, None].expand_as(grouped).reshape(t, moe.experts)
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = torch.topk(choice, moe.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if moe.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.scale, ids
