"""The peer every benchmark runs beside: transformers' model of the same checkpoint, same device and dtype."""

from __future__ import annotations


def reference_model(path, placement):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=placement.dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=placement.dtype)
    return model.to(placement.device).eval()
