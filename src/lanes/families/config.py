"""The shape of a decoder-only model, read from a Hugging Face config (GGUF metadata is mapped to one):
its attention, its dense MLP and, for Mixture-of-Experts families, how tokens are routed to experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


class ConfigFault(ValueError):
    """A config that names something this server cannot run; the loader adds the file's name."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: `kind` is default, linear, llama3, yarn or freq_factors (GGUF's divisors)."""

    theta: float
    kind: str = "default"
    params: tuple[tuple[str, Any], ...] = ()  # factor, low_freq_factor, ... as the config names them

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class MoEConfig:
    """A routed MoE block: `experts` experts of `intermediate_size` each, `top_k` of them a token.

    `routing` is "softmax" (probabilities over every expert, the top k kept) or "sigmoid" (GLM-4.5: each
    expert's sigmoid, chosen with a correction bias from the best `top_groups` of `groups` groups); the
    kept weights are renormalised to sum to 1 when `normalize`, then multiplied by `scale`. Layers in
    `dense_layers` run a dense MLP of the model's `intermediate_size` instead.
    """

    experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax"
    normalize: bool = False
    scale: float = 1.0
    groups: int = 1
    top_groups: int = 1
    correction_bias: bool = False  # sigmoid routing: a bias [experts] added to the scores that choose
    shared_size: int = 0  # the shared experts' intermediate size, run on every token (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output scaled by sigmoid(x w), w [1, hidden]
    fp32_weights: bool = False  # routing weights kept in float32 (Mixtral, GLM), else cast to the model's dtype
    dense_layers: frozenset[int] = frozenset()

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope: RopeConfig
    max_position: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen2-VL): rotary pairs driven by the t, h and w positions
    partial_rotary: float = 1.0  # the share of each head's dimensions RoPE rotates (GLM-4.5: 0.5), the first ones
    moe: MoEConfig | None = None

    @property
    def rotary_dim(self) -> int:
        """Dimensions of a head that RoPE rotates (the rest pass through), as transformers rounds them."""
        return int(self.head_dim * self.partial_rotary)


ROPE_KINDS = {"default", "linear", "llama3", "yarn", "freq_factors"}


def need(config: Mapping[str, Any], key: str) -> Any:
    if config.get(key) is None:
        raise ConfigFault(f"config has no {key!r}")
    return config[key]


def rope_from_hf(config: Mapping[str, Any]) -> RopeConfig:
    """RoPE as transformers 5 writes it (`rope_parameters`) or as older configs do (`rope_theta`, `rope_scaling`)."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "mrope":  # Qwen2-VL's hub configs: default frequencies, positions split by mrope_section
        kind = "default"
    if kind not in ROPE_KINDS:
        raise ConfigFault(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(sorted(ROPE_KINDS))})")
    return RopeConfig(theta=float(theta), kind=kind, params=tuple(sorted(params.items())))


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def decoder_config(config: Mapping[str, Any], family: str, **flags: Any) -> ModelConfig:
    """The fields every Llama-shaped decoder shares; `flags` are the family's own (bias, q/k norm, experts)."""
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigFault(f"activation {config['hidden_act']!r} is not supported (silu only)")
    window = config.get("sliding_window")  # Mixtral's configs give only this: a window past the context is none
    if config.get("use_sliding_window") or ("use_sliding_window" not in config and window and
                                            window < int(config.get("max_position_embeddings") or 4096)):
        raise ConfigFault("sliding-window attention is not supported")
    hidden = int(need(config, "hidden_size"))
    heads = int(need(config, "num_attention_heads"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigFault(f"{heads} attention heads do not divide into {kv_heads} KV heads")
    head_dim = int(config.get("head_dim") or hidden // heads)
    return ModelConfig(
        family=family,
        vocab_size=int(need(config, "vocab_size")),
        hidden_size=hidden,
        layers=int(need(config, "num_hidden_layers")),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(need(config, "intermediate_size")),
        rms_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope=rope_from_hf(config),
        max_position=int(config.get("max_position_embeddings") or 4096),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos(config.get("eos_token_id")),
        **flags,
    )
