"""Device-to-host reads packed into one copy: a pass's one host sync, however many tensors it returns."""

from __future__ import annotations

from typing import Sequence

import torch


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors (int64 or float32, any shapes) on the CPU, moved in one device-to-host copy.

    Each is flattened and viewed as int64 (float32 in pairs, padded by one when odd), concatenated, copied
    once, and cut back into its own shape and dtype.
    """
    parts, layout = [], []
    for t in tensors:
        flat = t.reshape(-1)
        if flat.dtype == torch.float32:
            if flat.numel() % 2:
                flat = torch.cat([flat, flat.new_zeros(1)])
            flat = flat.view(torch.int64)
        elif flat.dtype != torch.int64:
            raise TypeError(f"to_host packs int64 and float32 tensors, not {t.dtype}")
        parts.append(flat)
        layout.append((t.dtype, t.shape, flat.numel()))
    if not parts:
        return []
    packed = torch.cat(parts).cpu()  # the one sync
    out, at = [], 0
    for dtype, shape, n in layout:
        chunk = packed[at : at + n]
        at += n
        if dtype == torch.float32:
            chunk = chunk.view(torch.float32)[: int(torch.Size(shape).numel())]
        out.append(chunk.reshape(shape))
    return out


class PinnedRing:
    """Page-locked host buffers that copies to and from the device use without blocking the thread, taken
    in turn (each in-flight pass has its own).

    Allocated by the CUDA driver rather than torch's caching host allocator, which records events on the
    copying stream when its blocks are freed, and failed doing so for streams made by cuda-python. Never
    freed: a few hundred kilobytes, alive as long as a copy into or out of them might be.
    """

    def __init__(self, slots: int, numel: int, dtype=torch.float64) -> None:
        import ctypes

        import numpy as np
        from cuda.bindings import driver

        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self._views = []
        for _ in range(slots):
            err, pointer = driver.cuMemHostAlloc(nbytes, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuMemHostAlloc of {nbytes} bytes failed: {err}")
            raw = np.frombuffer((ctypes.c_byte * nbytes).from_address(int(pointer)), dtype=np.uint8)
            self._views.append(torch.from_numpy(raw).view(dtype))
        self._next = 0

    @property
    def slots(self) -> int:
        return len(self._views)

    def take(self) -> torch.Tensor:
        """The next buffer [numel] (the one used `slots` takes ago)."""
        view = self._views[self._next]
        self._next = (self._next + 1) % len(self._views)
        return view
