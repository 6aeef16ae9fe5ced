"""The gated MLP part: down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel product,
down row-parallel. A dense layer's feed-forward, and an MoE block's shared experts."""

from __future__ import annotations

import torch

from ..gpu.collective import Collective
from ..quant import stack_rows
from .activation import silu_mul
from .linear import Linear, RowParallel
from .weights import Reader, Shard


class GatedMLP:
    """gate_up [2 * I / world, hidden] (this rank's gate rows, then its up rows), down [hidden, I / world]."""

    def __init__(self, gate_up: Linear, down: RowParallel, eps: float) -> None:
        self.gate_up, self.down, self.eps = gate_up, down, eps

    @staticmethod
    def tensors(bias: bool) -> int:
        """How many tensors `load` reads."""
        return 3 + 3 * bias

    @classmethod
    def load(cls, read: Reader, prefix: str, hidden: int, intermediate: int, bias: bool, shard: Shard,
             comm: Collective, eps: float) -> "GatedMLP":
        """`prefix` ends where gate_proj, up_proj and down_proj follow (e.g. "mlp.", "mlp.shared_expert.")."""

        def gate_up(kind: str, tail: tuple[int, ...]):
            read_one = read.weight if kind == "weight" else read.get
            gate = read_one(prefix + f"gate_proj.{kind}", (intermediate, *tail), dim=0, part=shard.column)
            up = read_one(prefix + f"up_proj.{kind}", (intermediate, *tail), dim=0, part=shard.column)
            return stack_rows([gate, up]) if kind == "weight" else torch.cat([gate, up]).contiguous()

        fused = Linear(gate_up("weight", (hidden,)), gate_up("bias", ()) if bias else None)
        down = RowParallel(read.weight(prefix + "down_proj.weight", (hidden, intermediate), dim=1, part=shard.column),
                           read.get(prefix + "down_proj.bias", (hidden,)) if bias else None, comm)
        return cls(fused, down, eps)

    graph_safe = True  # no host reads: the graphed step may capture it

    def one_row_ready(self) -> bool:
        return self.gate_up.one_row_ready() and self.down.linear.one_row_ready()

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] (normed) -> silu(gate) * up: [T, I / world]."""
        return silu_mul(self.gate_up(h))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [T, hidden] (normed) -> [T, hidden], summed across ranks."""
        return self.down(self.act(h))

    __call__ = forward

    def partial(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's share of `forward(h)` before the sum (an MoE block sums its parts once)."""
        return self.down.partial(self.act(h))

    def fast(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor,
             one: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The graphed step's MLP: x, residual [B, hidden] -> (MLP output [B, hidden], x + residual), the
        residual add and norm fused into one kernel (one row: into the gate/up GEMV, with SiLU and the product)."""
        from ..gpu import kernels

        if one:
            act, residual = self.gate_up.norm_gate_up_silu(x, residual, norm, self.eps)
            return self.down.linear.gemv(act), residual
        h, residual = kernels.add_rms_norm(x, residual, norm, self.eps)
        return self.down(kernels.silu_mul(self.gate_up(h))), residual
