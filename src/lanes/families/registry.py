"""Families by the names checkpoints give them: `model_type`, `architectures`, GGUF `general.architecture`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .config import ConfigFault, ModelConfig
from .names import MoENames


@dataclass(frozen=True)
class Family:
    """A model family: the names it answers to, how its config reads, and where its experts' tensors are
    (None: a dense family). Its layers are composed from the config: attention, then a gated MLP or, in
    the layers the config routes, an MoE block."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    config: Callable[[Mapping[str, Any]], ModelConfig]
    experts: MoENames | None = None


_FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    _FAMILIES.append(family)
    return family


def families() -> list[Family]:
    _load_builtin()
    return list(_FAMILIES)


def family_for(config: Mapping[str, Any]) -> Family:
    """The family a config names by `model_type`, else by `architectures`; ConfigFault when none does."""
    _load_builtin()
    model_type = config.get("model_type")
    for family in _FAMILIES:
        if model_type in family.model_types:
            return family
    for architecture in config.get("architectures") or ():
        for family in _FAMILIES:
            if architecture in family.architectures:
                return family
    known = ", ".join(sorted(f.name for f in _FAMILIES))  # sorted: registration order depends on imports
    named = model_type or ", ".join(config.get("architectures") or ()) or "nothing"
    raise ConfigFault(f"unknown architecture {named!r} (supported families: {known})")


def _load_builtin() -> None:
    # each registers itself on import
    from . import glm4_moe, llama, mixtral, qwen2, qwen2_moe, qwen2_vl, qwen3, qwen3_moe  # noqa: F401
