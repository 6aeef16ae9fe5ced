"""What a checkpoint's tensors look like to a family: named tensors, read one at a time."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch


class TensorSource(Protocol):
    """Tensors under Hugging Face names, read one at a time on the host.

    `get` returns the whole tensor, or with `dim` set the `rank`-th of `world` equal parts along `dim`
    (the dimension must divide evenly; callers pad first where it does not). The dtype is the stored one
    (or float32 for dequantized blocks); the caller converts and moves it to the device, so no more than one
    tensor of a model is ever held on the host.
    """

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor: ...
