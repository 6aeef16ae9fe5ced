"""The device layer: choosing a device and dtype, and running passes without blocking the event loop.

Rules: the CPU tests run everywhere; the CUDA tests run only where cuda-python finds a GPU (skipped
cleanly elsewhere). Every test that awaits is under `trio.fail_after`.
"""

import threading

import pytest
import torch
import trio

import scenario
import tiny
from lanes.gpu.blocks import BlockPool
from lanes.gpu.device import CpuRunner, DeviceError, choose, cuda_device_count, runner_for
from lanes.loader import load_model

needs_cuda = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")


def test_cpu_defaults_to_fp32_and_dtype_overrides():
    assert choose("cpu") .dtype == torch.float32
    assert choose("cpu", "bf16").dtype == torch.bfloat16
    assert choose("cpu", "fp16").describe() == "cpu float16"
    with pytest.raises(DeviceError, match="--dtype int3: expected auto, bf16, fp16 or fp32"):
        choose("cpu", "int3")
    with pytest.raises(DeviceError, match="--device tpu: expected auto, cpu, cuda or cuda:N"):
        choose("tpu")


@pytest.mark.skipif(cuda_device_count() > 0, reason="a GPU is present")
def test_without_a_gpu_auto_is_the_cpu_and_cuda_is_refused():
    assert choose().device.type == "cpu"
    with pytest.raises(DeviceError, match="--device cuda: 0 CUDA device\\(s\\) found \\(no driver or no GPU\\)"):
        choose("cuda")


async def test_cpu_pass_runs_off_the_event_loop():
    runner = CpuRunner()
    started, release = threading.Event(), threading.Event()

    def blocking_pass() -> str:
        started.set()
        assert release.wait(10)  # held until the event loop proves it is free
        return threading.current_thread().name

    async def free_the_pass():
        await trio.to_thread.run_sync(started.wait)
        release.set()  # runs on the event loop while the pass still holds its thread

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(free_the_pass)
            name = await runner.run(blocking_pass)
    assert name != threading.main_thread().name


@needs_cuda
async def test_cuda_pass_runs_on_the_cuda_python_stream_and_awaits_its_event():
    placement = choose("cuda", "bf16")
    runner = runner_for(placement)
    a = torch.randn(8192, 8192, device=placement.device, dtype=torch.bfloat16)
    ticks = 0

    def long_pass():
        assert torch.cuda.current_stream().cuda_stream == int(runner.stream.handle)
        out = a
        for _ in range(60):
            out = (out @ a).clamp_(-1, 1)
        return out.sum()

    async def ticker(cancel):
        nonlocal ticks
        while not cancel.cancel_called:
            await trio.sleep(0.001)
            ticks += 1

    with trio.fail_after(60):
        await runner.run(lambda: a.sum())  # warm-up: cuBLAS handles and workspaces
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker, nursery.cancel_scope)
            start = trio.current_time()
            total = await runner.run(long_pass)
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
    assert torch.isfinite(total.float()).item()
    assert elapsed > 0.02  # the GPU work is long enough to matter
    assert ticks >= 10  # the loop kept running while the GPU worked
    runner.close()


@needs_cuda
@pytest.mark.parametrize("kind, overrides", [("llama", dict(num_key_value_heads=2)), ("qwen3", dict(tie_word_embeddings=True))])
def test_family_on_cuda_fp32_equals_transformers(kind, overrides, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = tiny.build(kind, tmp_path, **overrides).to("cuda")
    model = load_model(tmp_path, choose("cuda", "fp32"), kv_blocks=64, quiet=True)
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    ours = scenario.run(model.decoder, pool, prompt_ids, steps=8)
    theirs = scenario.reference(reference, prompt_ids, ours[2], steps=8, device="cuda")
    for mine, ref in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    assert ours[2] == theirs[2]
    pool.check_integrity()


@needs_cuda
def test_family_on_cuda_bf16_errs_no_more_than_transformers_bf16(tmp_path):
    """Both bf16 runs against an fp32 reference: ours no worse than transformers' own bf16 error (this random
    model amplifies rounding: transformers' bf16 logits are 2.5% off fp32 on the H200)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = tiny.build("qwen2", tmp_path, hidden_size=128, intermediate_size=256).to("cuda")
    model = load_model(tmp_path, choose("cuda", "bf16"), kv_blocks=64, quiet=True)
    pool = BlockPool(model.kv_blocks)
    prompt_ids = scenario.prompts(model.config.vocab_size)
    ours = scenario.run(model.decoder, pool, prompt_ids, steps=4)
    fp32 = scenario.reference(exact, prompt_ids, ours[2], steps=4, device="cuda")
    theirs = scenario.reference(exact.to(torch.bfloat16), prompt_ids, ours[2], steps=4, device="cuda")

    def error(rows):
        return max(((r.float() - f).norm() / f.norm()).item() for r, f in zip(rows, fp32[0] + fp32[1]))

    ours_error, theirs_error = error(ours[0] + ours[1]), error(theirs[0] + theirs[1])
    assert ours_error < 5e-2 and ours_error <= 1.25 * theirs_error, (ours_error, theirs_error)
    pool.check_integrity()
