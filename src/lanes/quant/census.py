"""What a model's weights are held as: each tensor's type and the bytes it keeps resident (for /v1/info and
the checks of memory against a file's size)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .weight import DenseWeight, QuantWeight, StackedWeight

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class Census:
    """Tensors and resident bytes by type name ("Q4_1", "F32", "Q6_K (held as F32)", ...)."""

    tensors: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    @property
    def resident_bytes(self) -> int:
        return sum(self.bytes.values())

    def add(self, name: str, nbytes: int) -> None:
        self.tensors[name] = self.tensors.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + nbytes

    def as_json(self) -> dict:
        types = {name: {"tensors": self.tensors[name], "bytes": self.bytes[name]} for name in sorted(self.tensors)}
        return {"types": types, "resident_bytes": self.resident_bytes}


def census(root: object) -> Census:
    """Every tensor and weight reachable from `root` (a model's weights: dataclasses, parts, lists), each
    counted once however many parts share it (a tied head is the embedding); a tensor held by a DenseWeight
    is counted under the DenseWeight's type (what it was read from)."""
    reached: dict[int, object] = {}
    stack = [root]
    while stack:
        item = stack.pop()
        if item is None or id(item) in reached:
            continue
        reached[id(item)] = item
        if isinstance(item, StackedWeight):
            stack.extend(item.parts)
        elif isinstance(item, DenseWeight):
            stack.append(item.tensor)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif not isinstance(item, (torch.Tensor, QuantWeight)) and hasattr(item, "__dict__") and _part(type(item).__module__):
            stack.extend(vars(item).values())
    found = Census()
    held = {id(w.tensor) for w in reached.values() if isinstance(w, DenseWeight)}
    for key, item in reached.items():
        if isinstance(item, (QuantWeight, DenseWeight)):
            found.add(item.type_name, item.resident_bytes)
        elif isinstance(item, torch.Tensor) and key not in held:
            found.add(DTYPES.get(item.dtype, str(item.dtype).removeprefix("torch.")), item.nbytes)
    return found


def _part(module: str) -> bool:
    """Model parts are walked into; the collectives (lanes.gpu) hold no weights, only peers' buffers."""
    return module.startswith("lanes.") and not module.startswith("lanes.gpu.")
