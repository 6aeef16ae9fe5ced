"""The peer every benchmark runs beside: transformers' model of the same checkpoint, same device and dtype."""

from __future__ import annotations


def reference_model(path, placement, experts_implementation: str | None = None):
    """`experts_implementation`: how transformers runs an MoE model's experts (None: its default)."""
    from transformers import AutoModelForCausalLM

    options = {"experts_implementation": experts_implementation} if experts_implementation else {}
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=placement.dtype, **options)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=placement.dtype, **options)
    return model.to(placement.device).eval()
