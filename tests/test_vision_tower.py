"""The Qwen2-VL and Qwen2.5-VL vision towers against transformers' visual module.

Rules: tiny random models built in the test with transformers (`from_config`, every weight random,
`save_pretrained` to a temp folder), read back through our safetensors source; fp32 on the CPU; random
pixel values from a fixed seed; merged embeddings within 1e-4 (max abs) of transformers'.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

import tiny
from lanes.checkpoint.errors import CheckpointError
from lanes.checkpoint.safetensors_source import SafetensorsSource
from lanes.families.config import ConfigFault
from lanes.families.vision_tower import VisionTower, vision_tensor_count
from lanes.families.vision_tower_config import vision_config
from lanes.families.vision_tower_layout import segment_groups, window_order

TEXT = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 2]})
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    # window_size 16 px = 2 x 2 merged tokens a window; blocks 1 and 3 attend over whole frames
    "qwen2_5_vl": dict(depth=4, hidden_size=32, out_hidden_size=48, intermediate_size=40, num_heads=4, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=16,
                       fullatt_block_indexes=[1, 3]),
}
GRIDS = {
    "one-image": [(1, 6, 8)],
    "two-images": [(1, 4, 6), (1, 8, 4)],
    "video": [(3, 4, 6)],
    "uneven-windows": [(1, 6, 10)],
    "mixed": [(1, 8, 8), (2, 6, 10), (1, 8, 8), (1, 2, 2)],
}
CASES = [(f, g) for f in VISION for g in GRIDS]


def _build(family, folder):
    import transformers

    config_class, model_class = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    }[family]
    torch.manual_seed(0)
    model = model_class(config_class(vision_config=VISION[family], text_config=TEXT, bos_token_id=0, eos_token_id=1)).eval()
    tiny.randomize(model, seed=1)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (transformers model, saved folder), built once for the module."""
    return {family: (_build(family, folder := tmp_path_factory.mktemp(family)), folder) for family in VISION}


def _tower(folder, family, dtype=torch.float32):
    config = vision_config(json.loads((folder / "config.json").read_text()), family)
    return VisionTower.load(config, SafetensorsSource(folder), folder, device=torch.device("cpu"), dtype=dtype)


def _pixels(tower, grids, seed=2):
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, tower.config.patch_dim, generator=torch.Generator().manual_seed(seed))


def _reference(model, pixels, grids):
    with torch.no_grad():
        out = model.model.visual(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output


@pytest.mark.parametrize("family,grids", CASES, ids=[f"{f}-{g}" for f, g in CASES])
def test_tower_equals_transformers(built, family, grids):
    model, folder = built[family]
    tower = _tower(folder, family)
    pixels = _pixels(tower, GRIDS[grids])
    ours = tower.encode(pixels, GRIDS[grids])
    theirs = _reference(model, pixels, GRIDS[grids])
    merged = sum(t * h * w for t, h, w in GRIDS[grids]) // 4
    assert ours.shape == theirs.shape == (merged, 48)
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("grids", sorted(GRIDS))
def test_window_order_equals_transformers(grids):
    from transformers.vision_utils import get_vision_window_index

    theirs_order, theirs_bounds = get_vision_window_index(torch.tensor(GRIDS[grids]), 2, 16, 4)
    order, lengths = window_order(GRIDS[grids], merge=2, window=2)
    assert order.tolist() == theirs_order.tolist()
    assert [0, *torch.tensor(lengths).cumsum(0).tolist()] == theirs_bounds.tolist()


def test_windows_are_several_and_uneven():
    order, lengths = window_order([(1, 6, 10)], merge=2, window=2)
    # 3 x 5 merged tokens in 2 x 2 tiles: two full tiles, then the right edge, then the bottom row's three
    assert lengths == [16, 16, 8, 8, 8, 4]
    assert order.tolist() == [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14]
    order, lengths = window_order([(2, 8, 8)], merge=2, window=2)
    assert lengths == [16] * 8  # tiles that fit exactly: no empty windows


def test_segment_groups_batch_equal_lengths():
    groups = segment_groups([4, 6, 4, 0, 6, 6], torch.device("cpu"))
    assert [(g.length, g.count) for g in groups] == [(4, 2), (6, 3)]
    assert groups[0].rows.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert groups[1].rows.tolist() == [*range(4, 10), *range(14, 26)]
    (only,) = segment_groups([5, 5, 5], torch.device("cpu"))
    assert (only.length, only.count, only.rows) == (5, 3, None)


def test_in_memory_names_load_too(built, tmp_path):
    model, _ = built["qwen2_5_vl"]
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k.startswith("model.visual.")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    tower = _tower(tmp_path, "qwen2_5_vl")
    grids = [(1, 6, 10)]
    pixels = _pixels(tower, grids)
    assert (tower.encode(pixels, grids) - _reference(model, pixels, grids)).abs().max().item() < 1e-4


# vision_config as the hub's Qwen2-VL-2B-Instruct and Qwen2.5-VL-7B-Instruct write it (older field names)
HUB_QWEN2 = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 1536,
             "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2}
HUB_QWEN25 = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
              "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
              "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
              "temporal_patch_size": 2}


def test_hub_style_configs():
    qwen2 = vision_config({"vision_config": HUB_QWEN2}, "qwen2_vl")
    assert (qwen2.embed_dim, qwen2.intermediate_size, qwen2.out_hidden_size) == (1280, 5120, 1536)
    assert (qwen2.hidden_act, qwen2.patch_dim, qwen2.window_tokens, qwen2.full_attention_blocks) == ("quick_gelu", 1176, 0, ())
    qwen25 = vision_config({"vision_config": HUB_QWEN25}, "qwen2_5_vl")
    assert (qwen25.embed_dim, qwen25.head_dim, qwen25.out_hidden_size) == (1280, 80, 3584)
    assert (qwen25.window_tokens, qwen25.full_attention_blocks) == (4, (7, 15, 23, 31))
    assert vision_tensor_count(qwen25) == 390
    with pytest.raises(ConfigFault, match="vision_config"):
        vision_config({}, "qwen2_vl")
    with pytest.raises(ConfigFault, match="activation"):
        vision_config({"vision_config": {"hidden_act": "relu"}}, "qwen2_5_vl")


def test_bad_inputs_are_refused(built):
    tower = _tower(built["qwen2_vl"][1], "qwen2_vl")
    with pytest.raises(ValueError, match="do not match"):
        tower.encode(torch.zeros(47, tower.config.patch_dim), [(1, 6, 8)])
    with pytest.raises(ValueError, match="h, w divisible by 2"):
        tower.encode(torch.zeros(15, tower.config.patch_dim), [(1, 3, 5)])


def test_missing_tensor_is_named(built, tmp_path):
    model, _ = built["qwen2_vl"]
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k.startswith("model.visual.") and "blocks.1.mlp.fc2" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    config = vision_config(model.config.to_dict(), "qwen2_vl")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.visual\.blocks\.1\.mlp\.fc2\.weight'"):
        VisionTower.load(config, SafetensorsSource(tmp_path), tmp_path, device=torch.device("cpu"), dtype=torch.float32)


def test_bfloat16_stays_close(built):
    model, folder = built["qwen2_5_vl"]
    grids = GRIDS["mixed"]
    tower = _tower(folder, "qwen2_5_vl", torch.bfloat16)
    pixels = _pixels(tower, grids)
    ours = tower.encode(pixels, grids)
    assert ours.dtype == torch.bfloat16
    reference = _reference(model, pixels, grids)
    assert ((ours.float() - reference).abs().max() / reference.abs().max()).item() < 0.05
