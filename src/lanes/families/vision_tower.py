"""The vision encoders of Qwen2-VL and Qwen2.5-VL: patches in, one language-model embedding per merge block out.

The tower is replicated on every tensor-parallel rank (it is small beside the decoder, and each rank then
holds the image rows it splices into its own prompt rows). Inference only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from ..checkpoint.errors import CheckpointError
from ..checkpoint.source import TensorSource
from ..progress import Progress
from .decoder import rms_norm
from .rope import apply_rotary
from .vision_tower_config import VisionConfig
from .vision_tower_layout import Grid, GridLayout, SegmentGroup
from .weights import Reader

PREFIXES = ("visual.", "model.visual.")  # as transformers saves it, and its in-memory (and 4.5x) name

ACTIVATION_FNS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass
class BlockWeights:
    norm1: torch.Tensor  # [embed]
    norm1_bias: torch.Tensor | None  # LayerNorm's (Qwen2-VL); None for RMSNorm (Qwen2.5-VL)
    qkv: torch.Tensor  # [3 * embed, embed]: all q rows, then k, then v, head after head
    qkv_bias: torch.Tensor  # [3 * embed]
    proj: torch.Tensor  # [embed, embed]
    proj_bias: torch.Tensor  # [embed]
    norm2: torch.Tensor
    norm2_bias: torch.Tensor | None
    fc1: torch.Tensor  # [inter, embed] (Qwen2-VL), or gate then up [2 * inter, embed] (Qwen2.5-VL)
    fc1_bias: torch.Tensor
    fc2: torch.Tensor  # [embed, inter]
    fc2_bias: torch.Tensor


@dataclass
class MergerWeights:
    norm: torch.Tensor  # [embed]
    norm_bias: torch.Tensor | None
    fc1: torch.Tensor  # [merged, merged], merged = embed * merge**2
    fc1_bias: torch.Tensor
    fc2: torch.Tensor  # [out_hidden, merged]
    fc2_bias: torch.Tensor


@dataclass
class TowerWeights:
    patch: torch.Tensor  # [embed, patch_dim]: the Conv3d's kernel, flattened as pixel_values' rows are
    blocks: list[BlockWeights]
    merger: MergerWeights


def tower_prefix(names: Iterable[str], path: Path) -> str:
    """The prefix the checkpoint keeps its vision tower under; CheckpointError when it has none."""
    names = set(names)
    for prefix in PREFIXES:
        if prefix + "patch_embed.proj.weight" in names:
            return prefix
    raise CheckpointError(path, "no vision tower (no 'visual.patch_embed.proj.weight')")


def vision_tensor_count(config: VisionConfig) -> int:
    """How many tensors `VisionTower.load` reads (for the progress bar)."""
    return 1 + 12 * config.depth + (6 if config.family == "qwen2_vl" else 5)


def load_tower_weights(
    config: VisionConfig,
    source: TensorSource,
    path: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> TowerWeights:
    """Every tensor of the tower, whole; missing or misshapen tensors raise CheckpointError."""
    read = Reader(source, path, device, dtype, progress)
    p = tower_prefix(read.names, path)
    c = config
    e, inter, layer_norm = c.embed_dim, c.intermediate_size, c.family == "qwen2_vl"
    conv = read.get(p + "patch_embed.proj.weight", (e, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size))

    def norm(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return read.get(name + ".weight", (e,)), read.get(name + ".bias", (e,)) if layer_norm else None

    def linear(name: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return read.get(name + ".weight", (rows, cols)), read.get(name + ".bias", (rows,))

    blocks = []
    for i in range(config.depth):
        b = f"{p}blocks.{i}."
        if layer_norm:
            fc1, fc1_bias = linear(b + "mlp.fc1", inter, e)
            fc2, fc2_bias = linear(b + "mlp.fc2", e, inter)
        else:
            gate, gate_bias = linear(b + "mlp.gate_proj", inter, e)
            up, up_bias = linear(b + "mlp.up_proj", inter, e)
            fc1, fc1_bias = torch.cat([gate, up]), torch.cat([gate_bias, up_bias])
            fc2, fc2_bias = linear(b + "mlp.down_proj", e, inter)
        norm1, norm1_bias = norm(b + "norm1")
        qkv, qkv_bias = linear(b + "attn.qkv", 3 * e, e)
        proj, proj_bias = linear(b + "attn.proj", e, e)
        norm2, norm2_bias = norm(b + "norm2")
        blocks.append(
            BlockWeights(
                norm1=norm1, norm1_bias=norm1_bias, qkv=qkv, qkv_bias=qkv_bias, proj=proj, proj_bias=proj_bias,
                norm2=norm2, norm2_bias=norm2_bias, fc1=fc1, fc1_bias=fc1_bias, fc2=fc2, fc2_bias=fc2_bias,
            )
        )
    m = config.merged_dim
    ln, ln_bias = norm(p + "merger.ln_q")
    fc1, fc1_bias = linear(p + "merger.mlp.0", m, m)
    fc2, fc2_bias = linear(p + "merger.mlp.2", config.out_hidden_size, m)
    merger = MergerWeights(norm=ln, norm_bias=ln_bias, fc1=fc1, fc1_bias=fc1_bias, fc2=fc2, fc2_bias=fc2_bias)
    return TowerWeights(patch=conv.reshape(e, -1).contiguous(), blocks=blocks, merger=merger)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Sequence[SegmentGroup], scale: float
) -> torch.Tensor:
    """q, k, v: [N, H, D]; each row attends to every row of its own segment and no other. Returns [N, H, D]."""
    n, heads, d = q.shape
    if len(groups) == 1 and groups[0].rows is None:
        g = groups[0]
        return _sdpa(*(t.view(g.count, g.length, heads, d) for t in (q, k, v)), scale=scale).reshape(n, heads, d)
    out = torch.empty_like(q)
    for g in groups:
        parts = (t.index_select(0, g.rows).view(g.count, g.length, heads, d) for t in (q, k, v))
        out.index_copy_(0, g.rows, _sdpa(*parts, scale=scale).reshape(-1, heads, d))
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    # q, k, v: [B, L, H, D] -> [B, L, H, D]; SDPA wants heads before rows
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


class VisionTower:
    """A checkpoint's vision encoder on one device; `encode` equals transformers' visual module's merged output."""

    def __init__(self, config: VisionConfig, weights: TowerWeights) -> None:
        self.config = config
        self.weights = weights
        self.device = weights.patch.device
        self.dtype = weights.patch.dtype
        self.act = ACTIVATION_FNS[config.hidden_act]
        self.scale = config.head_dim**-0.5

    @classmethod
    def load(
        cls,
        config: VisionConfig,
        source: TensorSource,
        path: Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        progress: Progress | None = None,
    ) -> "VisionTower":
        """The tower read tensor by tensor from `source` (under `visual.*` or `model.visual.*`) onto `device`."""
        return cls(config, load_tower_weights(config, source, path, device=device, dtype=dtype, progress=progress))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """pixel_values: [N, C*T*P*P] as the image processor gives them, any device and float dtype; grids:
        each image's or video's (t, h, w) in patches, in the rows' order. Returns [N / merge**2, out_hidden]
        in the tower's dtype on its device: one embedding per merged token, image after image, frame after frame."""
        c = self.config
        grids = [tuple(int(x) for x in g) for g in grids]
        self._check(pixel_values, grids)
        window = c.window_tokens if c.family == "qwen2_5_vl" else 0
        layout = GridLayout.build(
            grids, merge=c.merge_size, head_dim=c.head_dim, theta=c.rope_theta, window=window, device=self.device
        )
        unit = c.merge_size**2
        x = F.linear(pixel_values.to(self.device, self.dtype), self.weights.patch)  # [N, embed]
        if layout.order is not None:
            # whole merge blocks move into window order, so each window's rows are contiguous
            x = x.view(-1, unit, c.embed_dim).index_select(0, layout.order).view(-1, c.embed_dim)
        for i, block in enumerate(self.weights.blocks):
            full = layout.windows is None or i in c.full_attention_blocks
            x = self._block(x, block, layout, layout.frames if full else layout.windows)
        m = self.weights.merger
        x = self._norm(x, m.norm, m.norm_bias).view(-1, c.merged_dim)  # [N / merge**2, embed * merge**2]
        x = F.linear(F.gelu(F.linear(x, m.fc1, m.fc1_bias)), m.fc2, m.fc2_bias)  # [N / merge**2, out_hidden]
        return x if layout.restore is None else x.index_select(0, layout.restore)

    def _check(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> None:
        c = self.config
        if not grids:
            raise ValueError("encode needs at least one grid")
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % c.merge_size or w % c.merge_size:
                raise ValueError(f"grid {(t, h, w)} needs t, h, w >= 1 and h, w divisible by {c.merge_size}")
        rows = sum(t * h * w for t, h, w in grids)
        if tuple(pixel_values.shape) != (rows, c.patch_dim):
            raise ValueError(f"pixel_values {list(pixel_values.shape)} do not match the grids' [{rows}, {c.patch_dim}]")

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            return rms_norm(x, weight, self.config.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.config.norm_eps)

    def _block(self, x: torch.Tensor, w: BlockWeights, layout: GridLayout, groups: Sequence[SegmentGroup]) -> torch.Tensor:
        # x: [N, embed] in the tower's dtype
        c = self.config
        n = x.shape[0]
        h = self._norm(x, w.norm1, w.norm1_bias)
        q, k, v = F.linear(h, w.qkv, w.qkv_bias).view(n, 3, c.heads, c.head_dim).unbind(1)  # each [N, H, D]
        # the rotation runs in float32 whatever the tower's dtype, as the reference does
        q = apply_rotary(q.float(), layout.cos, layout.sin).to(x.dtype)
        k = apply_rotary(k.float(), layout.cos, layout.sin).to(x.dtype)
        attn = segment_attention(q, k, v, groups, self.scale).reshape(n, c.embed_dim)
        x = x + F.linear(attn, w.proj, w.proj_bias)
        h = F.linear(self._norm(x, w.norm2, w.norm2_bias), w.fc1, w.fc1_bias)  # [N, inter] or [N, 2 * inter]
        if c.family == "qwen2_vl":
            h = self.act(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        return x + F.linear(h, w.fc2, w.fc2_bias)
