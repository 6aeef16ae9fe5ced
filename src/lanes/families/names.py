"""Tensor names: where a family's checkpoint keeps each part's tensors (Hugging Face names), and llama.cpp's
GGUF names for the same tensors.

Every family names its attention (`self_attn.`), its norms and a dense MLP (`mlp.`) as Llama does; MoE
families differ in their experts' names (`MoENames`). A Hugging Face folder keeps each expert's matrices
apart (`mlp.experts.{e}.gate_proj.weight`); a GGUF file keeps them stacked in one 3-D tensor
(`blk.N.ffn_gate_exps.weight`), which reads under the expert name with the `{e}.` taken out.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION = "self_attn."
MLP = "mlp."
INPUT_NORM = "input_layernorm.weight"
POST_NORM = "post_attention_layernorm.weight"


@dataclass(frozen=True)
class MoENames:
    """An MoE block's tensors under `model.layers.N.`: the router [experts, hidden], each expert's three
    matrices (`experts` holds `{e}`), shared experts' MLP prefix and their gate, GLM's correction bias."""

    router: str  # without ".weight"
    experts: str
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str | None = None
    shared_gate: str | None = None  # without ".weight"
    correction: str | None = None  # the whole name: GLM writes it without a ".bias" of its own

    def expert(self, e: int, proj: str) -> str:
        return f"{self.experts.format(e=e)}{proj}.weight"

    def stacked(self, proj: str) -> str:
        """The name every expert's `proj` reads under when stacked (as GGUF stores it)."""
        return f"{self.experts.replace('{e}.', '')}{proj}.weight"



_GGUF_LAYER = {  # llama.cpp's names after "blk.N." -> the Llama names after "model.layers.N." (no suffix)
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # GLM-4.5's name for the same norm
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_layer_names(moe: MoENames | None) -> dict[str, str]:
    """A layer's GGUF tensor names after "blk.N." (suffix included) -> its Hugging Face names after
    "model.layers.N.", for a family whose experts are named `moe` (None: a dense family)."""
    stems = dict(_GGUF_LAYER)
    if moe is not None:
        stems["ffn_gate_inp"] = moe.router
        for gguf, proj in (("ffn_gate_exps", moe.gate), ("ffn_up_exps", moe.up), ("ffn_down_exps", moe.down)):
            stems[gguf] = moe.stacked(proj).removesuffix(".weight")
        if moe.shared is not None:
            for gguf, proj in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")):
                stems[gguf] = moe.shared + proj
        if moe.shared_gate is not None:
            stems["ffn_gate_inp_shexp"] = moe.shared_gate
    names = {f"{g}.{kind}": f"{hf}.{kind}" for g, hf in stems.items() for kind in ("weight", "bias")}
    if moe is not None and moe.correction is not None:
        names["exp_probs_b.bias"] = moe.correction
    return names
