"""The penalty ordering on a GPU: a lane rebound while a pass runs on the runner's stream, written at once
on the default stream (the old `bind`) against queued for the next pass (`flush` on the pass's stream).

    python bench/penalty_order.py

Prints what the running pass read in each case (2 is right: the count before the rebind).
"""
import torch
from lanes.backend.penalties import PenaltyState
from lanes.gpu.device import CudaRunner
d = torch.device("cuda")
lane = torch.tensor([0], device=d)
owner = CudaRunner(0)  # kept: its stream lives as long as it does
for old in (True, False):
    s = PenaltyState(2, 64, d); s.bind(0, [1, 2, 3])
    with torch.cuda.stream(owner.torch_stream):
        s.record(lane.repeat(2), torch.tensor([5, 5], device=d)); torch.cuda._sleep(200_000_000); seen = s.counts(lane).clone()
    s.unbind(0); s.bind(0, [7])
    if old:
        s.flush()  # the old bind: written at once, on the default stream
    torch.cuda.synchronize()
    print("old: written at once" if old else "now: queued for the next pass", "-> the running pass read count", int(seen[0, 5]), "(2 is right)")
