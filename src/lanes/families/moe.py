"""The routed MoE part: a router, the routed experts and, where the family has them, shared experts.

The experts run grouped: every (token, choice) pair is sorted by expert, each expert's rows go through
its matrices together (`ExpertLinear.grouped`), and the outputs are scattered back onto their tokens
with their routing weights; no Python loop visits tokens. Each rank holds a slice of every expert's
intermediate dimension (as a dense MLP is split), so the routed and the shared outputs are partial sums,
added and then summed across ranks once. Where torch's grouped product is one kernel (the CPU, and bf16
on Hopper: `linear.fused_on`) nothing is read on the host, so a CUDA graph may capture the block; elsewhere
the product loops over experts with rows, reading their counts on the host.
"""

from __future__ import annotations

import torch

from ..gpu.collective import Collective
from .activation import silu_mul
from .config import ModelConfig, MoEConfig
from .linear import ExpertLinear, Groups, Linear
from .mlp import GatedMLP
from .names import MoENames
from .routing import SigmoidGroupRouter, SoftmaxRouter
from .weights import Reader, Shard


class Experts:
    """The routed experts on this rank: gate_up [experts, 2 * I / world, hidden] (each expert's gate rows,
    then its up rows), down [experts, hidden, I / world]."""

    def __init__(self, gate_up: ExpertLinear, down: ExpertLinear) -> None:
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden]; weights, ids: [T, k] -> this rank's share of sum_j weights[t, j] * expert_ids[t, j](x[t])."""
        t, k = ids.shape
        ids, choice = ids.sort(dim=1)  # each token's experts ascending: its sum below runs in expert order, as the reference's
        weights = weights.gather(1, choice)
        picks = ids.reshape(-1)  # [T * k]
        order = torch.argsort(picks, stable=True)  # picks grouped by expert, in token order within each
        tokens = order // k  # [T * k]: the token of each sorted pick
        groups = Groups.of_sorted(picks.index_select(0, order), self.gate_up.weight.shape[0])
        rows = x.index_select(0, tokens)  # [T * k, hidden]
        out = self.down.grouped(silu_mul(self.gate_up.grouped(rows, groups)), groups)  # [T * k, hidden]
        out = (out * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
        picked = torch.empty_like(out).index_copy_(0, order, out).view(t, k, -1)  # back in (token, choice) order
        return picked.sum(dim=1, dtype=torch.float32).to(x.dtype)  # no atomics: the same sum every run


class MoE:
    """A layer's MoE block: `router` picks, `experts` compute, `shared` (a gated MLP, or None) runs on every
    token, scaled per token by sigmoid(`shared_gate`(x)) where the family has that gate."""

    def __init__(self, router: SoftmaxRouter | SigmoidGroupRouter, experts: Experts, shared: GatedMLP | None,
                 shared_gate: Linear | None, comm: Collective, eps: float) -> None:
        self.router, self.experts, self.shared, self.shared_gate = router, experts, shared, shared_gate
        self.comm, self.eps = comm, eps

    @staticmethod
    def tensors(moe: MoEConfig) -> int:
        """How many tensors `load` reads (the experts' stacked matrices count one each)."""
        return 4 + moe.correction_bias + (GatedMLP.tensors(False) if moe.shared_size else 0) + moe.shared_gate

    @classmethod
    def load(cls, read: Reader, prefix: str, names: MoENames, config: ModelConfig, shard: Shard,
             comm: Collective) -> "MoE":
        """`prefix` is the layer's ("model.layers.N."); `names` where the family keeps each tensor under it."""
        moe, hidden = config.moe, config.hidden_size
        inter, n = moe.intermediate_size, moe.experts

        def stacked(proj: str, shape: tuple[int, int], dim: int) -> torch.Tensor:
            each = [prefix + names.expert(e, proj) for e in range(n)]
            return read.stacked(each, prefix + names.stacked(proj), shape, dim=dim, part=shard.column)

        gate_up = torch.cat([stacked(names.gate, (inter, hidden), 0), stacked(names.up, (inter, hidden), 0)], dim=1)
        experts = Experts(ExpertLinear(gate_up.contiguous()), ExpertLinear(stacked(names.down, (hidden, inter), 1)))
        if moe.routing == "sigmoid":  # GLM keeps its router and correction bias in float32
            gate = Linear(read.get(prefix + names.router + ".weight", (n, hidden), dtype=torch.float32))
            bias = (read.get(prefix + names.correction, (n,), dtype=torch.float32) if moe.correction_bias
                    else torch.zeros(n, device=read.device))
            router = SigmoidGroupRouter(gate, bias, moe)
        else:
            router = SoftmaxRouter(Linear(read.get(prefix + names.router + ".weight", (n, hidden))), moe)
        shared = shared_gate = None
        if moe.shared_size:
            shared = GatedMLP.load(read, prefix + names.shared, hidden, moe.shared_size, False, shard, comm, config.rms_eps)
        if moe.shared_gate:
            shared_gate = Linear(read.get(prefix + names.shared_gate + ".weight", (1, hidden)))
        return cls(router, experts, shared, shared_gate, comm, config.rms_eps)

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph may hold the block: the experts' products read nothing on the host."""
        return self.experts.gate_up.graph_safe() and self.experts.down.graph_safe()

    def one_row_ready(self) -> bool:
        return True  # the graphed step runs the block as it is, with no GEMV of its own

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] (normed) -> [T, hidden], summed across ranks."""
        weights, ids = self.router(h)
        out = self.experts(h, weights, ids)
        if self.shared is not None:
            shared = self.shared.partial(h)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(h)) * shared
            out = out + shared
        return self.comm.all_reduce(out)

    __call__ = forward

    def fast(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor,
             one: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed step's block: the residual add and norm fused, then `forward` as it is."""
        from ..gpu import kernels

        h, residual = kernels.add_rms_norm(x, residual, norm, self.eps)
        return self.forward(h), residual
