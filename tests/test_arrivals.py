"""Arrival counters: each captured graph owns its own; uncaptured launches share one set a stream and use.

Rules: Triton's interpreter on the CPU (TRITON_INTERPRET=1) or a GPU, else skips; the split attention is
checked against a whole-context reference with counters from a scope, twice (the counters are zeroed again).
"""

import os

import pytest
import torch

from lanes.gpu.device import cuda_device_count

if cuda_device_count() == 0 and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter is not on (TRITON_INTERPRET=1)", allow_module_level=True)
DEVICE = torch.device("cuda" if cuda_device_count() else "cpu")
pytest.importorskip("triton")

from lanes.gpu import kernels  # noqa: E402


def test_a_scope_owns_its_counters_and_outside_ones_are_per_use():
    shared = kernels.arrival_counts(DEVICE, 8)
    assert kernels.arrival_counts(DEVICE, 8) is shared
    assert kernels.arrival_counts(DEVICE, 8, "gemv") is not shared
    first, second = {}, {}
    with kernels.arrival_scope(first):
        mine = kernels.arrival_counts(DEVICE, 8)
        assert mine is not shared and kernels.arrival_counts(DEVICE, 8) is mine
        with kernels.arrival_scope(second):
            assert kernels.arrival_counts(DEVICE, 8) is not mine
        assert kernels.arrival_counts(DEVICE, 8) is mine
    assert kernels.arrival_counts(DEVICE, 8) is shared
    assert set(first) == {("attention", DEVICE)} and first[("attention", DEVICE)] is mine


def test_split_attention_with_a_graphs_counters_equals_the_whole_context():
    torch.manual_seed(0)
    lanes, hq, hkv, d, block, blocks = 2, 4, 2, 16, 16, 4
    q = torch.randn(lanes, hq, d, device=DEVICE)
    cache_k = torch.randn(blocks * lanes * block, hkv, d, device=DEVICE)
    cache_v = torch.randn(blocks * lanes * block, hkv, d, device=DEVICE)
    tables = torch.arange(lanes * blocks, dtype=torch.int32, device=DEVICE).view(lanes, blocks)
    lens = torch.tensor([37, 64], dtype=torch.int32, device=DEVICE)
    whole = kernels.paged_decode_attention(q, cache_k, cache_v, tables, lens, d ** -0.5, block, splits=1)
    counters: dict = {}
    with kernels.arrival_scope(counters):
        for _ in range(2):  # the last program to arrive zeroes its counter for the next launch
            split = kernels.paged_decode_attention(q, cache_k, cache_v, tables, lens, d ** -0.5, block, tile=16, splits=4)
            torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert counters and all(int(c.abs().sum()) == 0 for c in counters.values())
