"""The shape of a Qwen2-VL or Qwen2.5-VL vision encoder, read from a checkpoint config's `vision_config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .config import ConfigFault

VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower's sizes. `family` picks the block: qwen2_vl has LayerNorm and a fc1/fc2 MLP over
    frames; qwen2_5_vl has RMSNorm, a gated MLP and window attention outside `full_attention_blocks`."""

    family: str
    depth: int
    embed_dim: int  # width of the blocks
    heads: int
    intermediate_size: int  # the MLP's inner width
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # merge x merge patches become one language-model token
    in_channels: int
    out_hidden_size: int  # the merger's output: the language model's width
    hidden_act: str
    rope_theta: float = 10000.0
    window_size: int = 0  # in pixels (Qwen2.5-VL); 0 without window attention
    full_attention_blocks: tuple[int, ...] = ()
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads

    @property
    def patch_dim(self) -> int:
        """Values in one row of `pixel_values`: channels x temporal patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        return self.embed_dim * self.merge_size**2

    @property
    def window_tokens(self) -> int:
        """A window's side in merged tokens; 0 without window attention."""
        return self.window_size // self.merge_size // self.patch_size if self.window_size else 0


def _int(vision: Mapping[str, Any], *keys: str, default: int) -> int:
    for key in keys:
        if vision.get(key) is not None:
            value = vision[key]
            if isinstance(value, (list, tuple)) or int(value) != value:
                raise ConfigFault(f"vision_config {key!r} must be one integer, not {value!r}")
            return int(value)
    return default


def vision_config(config: Mapping[str, Any], family: str) -> VisionConfig:
    """The `vision_config` of a checkpoint config, with transformers' defaults where a field is absent
    (hub configs omit some, e.g. Qwen2-VL's `hidden_act`); ConfigFault for what this tower cannot run."""
    if family not in VISION_FAMILIES:
        raise ConfigFault(f"no vision tower for family {family!r} (supported: {', '.join(VISION_FAMILIES)})")
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ConfigFault("config has no 'vision_config'")
    common = dict(
        family=family,
        depth=_int(vision, "depth", "num_hidden_layers", default=32),
        heads=_int(vision, "num_heads", "num_attention_heads", default=16),
        patch_size=_int(vision, "patch_size", default=14),
        temporal_patch_size=_int(vision, "temporal_patch_size", default=2),
        merge_size=_int(vision, "spatial_merge_size", default=2),
        in_channels=_int(vision, "in_channels", "in_chans", default=3),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
    )
    if family == "qwen2_vl":
        embed = _int(vision, "embed_dim", default=1280)
        # Qwen2-VL's `hidden_size` is the merger's output; its blocks are `embed_dim` wide
        ratio = float(vision.get("mlp_ratio") or 4)
        parsed = VisionConfig(
            **common, embed_dim=embed, intermediate_size=int(embed * ratio),
            out_hidden_size=_int(vision, "hidden_size", default=3584),
            hidden_act=str(vision.get("hidden_act") or "quick_gelu"),
        )
    else:
        parsed = VisionConfig(
            **common, embed_dim=_int(vision, "hidden_size", default=3584),
            intermediate_size=_int(vision, "intermediate_size", default=3420),
            out_hidden_size=_int(vision, "out_hidden_size", default=3584),
            hidden_act=str(vision.get("hidden_act") or "silu"),
            window_size=_int(vision, "window_size", default=112),
            full_attention_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
        )
    _check(parsed)
    return parsed


def _check(c: VisionConfig) -> None:
    if c.hidden_act not in ACTIVATIONS:
        raise ConfigFault(f"vision activation {c.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if c.embed_dim % c.heads or c.head_dim % 4:
        raise ConfigFault(f"vision width {c.embed_dim} over {c.heads} heads needs a head size divisible by 4")
    if not c.rope_theta > 0:
        raise ConfigFault(f"vision rope_theta {c.rope_theta!r} must be positive")
    if c.family == "qwen2_5_vl" and c.window_tokens < 1:
        raise ConfigFault(f"window_size {c.window_size} is smaller than one merged patch ({c.merge_size * c.patch_size})")
    if min(c.depth, c.patch_size, c.temporal_patch_size, c.merge_size, c.in_channels) < 1:
        raise ConfigFault("vision_config sizes must be positive")
