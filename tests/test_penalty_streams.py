"""A lane's penalty state never changes under a pass still running on the device (CUDA only).

Rules: the pass runs on the runner's own stream (non-blocking: nothing orders it after the default
stream), held busy by `torch.cuda._sleep` before it reads the state, as it is while a forward runs; the lane is rebound for its next stream on the host
meanwhile. Written to the device at once on the default stream (the old `bind`), the rebind would land
before the pass's read; queued for the next pass's `flush`, it lands after it.
"""

import pytest
import torch

from lanes.backend.penalties import PenaltyState
from lanes.gpu.device import CudaRunner, cuda_device_count

pytestmark = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device")

SPIN = 200_000_000  # GPU cycles the pass waits before it reads: ~0.1 s, far past the host's rebind


def test_a_rebind_during_a_pass_lands_after_the_pass_reads():
    device = torch.device("cuda")
    state = PenaltyState(2, 64, device)
    state.bind(0, [1, 2, 3])
    lane = torch.tensor([0], device=device)
    owner = CudaRunner(0)  # kept: its stream lives as long as it does
    runner = owner.torch_stream
    with torch.cuda.stream(runner):
        state.record(lane.repeat(2), torch.tensor([5, 5], device=device))  # flushes the bind first
        torch.cuda._sleep(SPIN)
        seen_counts, seen_prompt = state.counts(lane).clone(), state.prompt_mask(lane).clone()
    state.unbind(0)  # the stream ends and the next one takes lane 0, while the pass still runs
    state.bind(0, [7])
    torch.cuda.current_stream(device).synchronize()  # anything the default stream was given has run
    runner.synchronize()
    assert seen_counts[0, 5].item() == 2 and int(seen_counts.sum()) == 2
    assert seen_prompt[0].nonzero().flatten().tolist() == [1, 2, 3]
    with torch.cuda.stream(runner):
        state.flush()  # the next pass's start
        after_counts, after_prompt = state.counts(lane), state.prompt_mask(lane)
    runner.synchronize()
    assert int(after_counts.sum()) == 0 and after_prompt[0].nonzero().flatten().tolist() == [7]
    state.check_integrity()
    owner.close()
