"""From a path to a model on a device: open the checkpoint, pick its family, read its shard, size the KV cache."""

from __future__ import annotations

import gc
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint.errors import CheckpointError
from .checkpoint.gguf_file import GGUFFile
from .checkpoint.gguf_config import hf_config
from .checkpoint.gguf_source import GGUFSource
from .checkpoint.safetensors_source import SafetensorsSource
from .checkpoint.source import TensorSource
from .families.config import ConfigFault, ModelConfig
from .families.decoder import Decoder
from .families.layers import load_decoder, tensor_count
from .families.names import gguf_layer_names
from .families.registry import Family, family_for
from .families.weights import Shard
from .families.vision_tower_config import VISION_FAMILIES
from .progress import Progress
from .quant import SCHEMES, census
from .quant.census import Census
from .core.blocks import BLOCK_SIZE, blocks_within
from .gpu.collective import Collective, Solo
from .gpu.device import Placement
from .gpu.fp8 import FP8
from .gpu.kv import KV_CACHES, KVCache, KVShape
from .heap import bound_heap_retention, release_free_heap

if TYPE_CHECKING:
    from .families.qwen2_vl import VisionTokens
    from .families.vision_tower import VisionTower
    from .text.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"


@dataclass
class Checkpoint:
    """An opened checkpoint: its config, family and tensors; nothing is on the device yet."""

    path: Path
    raw_config: dict[str, Any]
    config: ModelConfig
    family: Family
    source: TensorSource
    gguf: GGUFFile | None = None
    _tokenizer: "Tokenizer | None" = field(default=None, repr=False)

    def tokenizer(self) -> "Tokenizer":
        """Built once (a GGUF file's vocabulary is dropped when its tensors are released)."""
        from .text.tokenizer import Tokenizer

        if self._tokenizer is None:
            if self.gguf is not None:
                self._tokenizer = Tokenizer.from_gguf(self.gguf.metadata, self.path, self.config.vocab_size)
            else:
                self._tokenizer = Tokenizer.from_folder(self.path, self.config.vocab_size)
        return self._tokenizer


def open_checkpoint(path: Path | str) -> Checkpoint:
    """A Hugging Face folder or a GGUF file; every fault is a CheckpointError naming the file."""
    path = Path(path)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise CheckpointError(config_path, "missing: a Hugging Face model folder needs config.json")
        try:
            raw = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise CheckpointError(config_path, f"not valid JSON ({error})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(config_path, "not a JSON object")
        family, config = _family(raw, config_path)
        return Checkpoint(path, raw, config, family, SafetensorsSource(path))
    if path.is_file():
        with path.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise CheckpointError(path, "neither a GGUF file nor a Hugging Face model folder")
        file = GGUFFile(path)
        raw = hf_config(file)
        family, config = _family(raw, path)
        return Checkpoint(path, raw, config, family, GGUFSource(file, raw, gguf_layer_names(family.experts)), gguf=file)
    raise CheckpointError(path, "no such file or folder")


def _family(raw: dict[str, Any], where: Path) -> tuple[Family, ModelConfig]:
    try:
        family = family_for(raw)
        return family, family.config(raw)
    except (ConfigFault, TypeError, ValueError) as error:
        raise CheckpointError(where, str(error)) from None


@dataclass
class LoadedModel:
    """A checkpoint's shard on a device with its KV cache, ready for passes."""

    checkpoint: Checkpoint
    config: ModelConfig
    tokenizer: "Tokenizer"
    decoder: Decoder
    placement: Placement
    shard: Shard
    vision: "VisionTower | None" = None  # the vision tower, when asked for and the family has one
    vision_tokens: "VisionTokens | None" = None  # the placeholders a vision family's prompts use

    @property
    def kv_blocks(self) -> int:
        return self.decoder.kv.blocks

    def weights_census(self) -> Census:
        """Each weight's type (counts by type) and the bytes the weights keep resident."""
        return census(self.decoder.weights)


def default_kv_bytes(placement: Placement) -> int:
    """The KV budget when none is given: 2 GiB on the CPU, 85% of what is free on a GPU after the weights."""
    if placement.is_cuda:
        free, _ = torch.cuda.mem_get_info(placement.device)
        return int(free * 0.85)
    return 2 << 30


def load_model(
    path: Path | str,
    placement: Placement,
    *,
    shard: Shard = Shard(),
    comm: Collective | None = None,
    kv_bytes: int | None = None,
    kv_blocks: int | None = None,
    kv_max_blocks: int | None = None,
    quiet: bool = False,
    vision: bool = False,
    kv_cache: str = "auto",
    quantize: str | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """Open, read this shard's weights onto the device with a progress bar, and allocate the KV cache
    (`kv_cache`: "auto", the model's dtype, or "fp8"; a byte budget holds nearly twice the blocks in fp8
    as in bf16); with `vision`, also the vision tower of a family that has one (CheckpointError for one that
    has none). A GGUF file's block formats stay as they are on the CPU; `quantize` ("int8", "int4")
    quantizes a full-precision checkpoint's matrices (QuantizeRefused where that cannot be done here);
    `dequantize` reads a GGUF file's blocks as tensors in the placement's dtype instead (as on a CPU without
    the kernels: for comparing against full-precision products)."""
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, not {kv_cache!r}")
    if placement.device.type == "cpu":
        bound_heap_retention()  # a CPU's activations are host memory: no burst's peak stays resident
    checkpoint = open_checkpoint(path)
    config = checkpoint.config
    tokenizer = checkpoint.tokenizer()
    try:
        shard.check(config)
    except ValueError as error:
        raise CheckpointError(checkpoint.path, str(error)) from None
    stream = io.StringIO() if quiet else sys.stderr
    comm = comm or Solo()
    kept = kernels_for(checkpoint, placement, quantize, stream) and not dequantize
    label = f"loading {checkpoint.path.name} ({load_action(checkpoint, placement, quantize, kept)})"
    with Progress(label, tensor_count(config), stream=stream, unit="tensors") as progress:
        weights = load_decoder(config, checkpoint.source, checkpoint.path, shard=shard, device=placement.device,
                               dtype=placement.dtype, experts=checkpoint.family.experts, comm=comm, progress=progress,
                               quantize=quantize, keep_blocks=not dequantize)
    kv_shape = KVShape(config.layers, shard.kv_heads(config), config.head_dim, BLOCK_SIZE)
    fp8 = kv_cache == "fp8"
    if kv_blocks is None:
        budget = kv_bytes if kv_bytes is not None else default_kv_bytes(placement)
        kv_blocks = blocks_within(budget, kv_shape.bytes_per_block(FP8 if fp8 else placement.dtype))
        if kv_max_blocks is not None:
            kv_blocks = min(kv_blocks, kv_max_blocks)
    kv = KVCache(kv_shape, kv_blocks, device=placement.device, dtype=placement.dtype, fp8=fp8)
    decoder = Decoder(config, weights, kv, comm, shard)
    model = LoadedModel(checkpoint, config, tokenizer, decoder, placement, shard)
    if config.family in VISION_FAMILIES:
        from .families.qwen2_vl import vision_tokens

        model.vision_tokens = vision_tokens(checkpoint.raw_config, config.family)
    if vision:
        model.vision = load_vision_tower(checkpoint, placement, stream)
    if checkpoint.gguf is not None:
        checkpoint.gguf.release()  # every weight is a copy now
    gc.collect()
    release_free_heap()
    return model


class QuantizeRefused(ValueError):
    """`--quantize` asked of a checkpoint or device it cannot apply to; the message says why in one line."""


def kernels_for(checkpoint: Checkpoint, placement: Placement, quantize: str | None, stream) -> bool:
    """Whether weights are kept quantized in this load. On the CPU the kernels are built first (a progress
    step; the first time about a minute, then loaded from `$LANES_HOME/kernels`): every CPU pass runs their
    fp32 set, so a first request never waits on a build, and a GGUF file or `quantize` needs the quantized set."""
    if quantize is not None:
        if quantize not in SCHEMES:
            raise QuantizeRefused(f"--quantize takes {' or '.join(SCHEMES)}, not {quantize!r}")
        if checkpoint.gguf is not None:
            raise QuantizeRefused("--quantize is for full-precision checkpoints; a GGUF file's weights keep their own types")
        if placement.device.type != "cpu":
            raise QuantizeRefused("--quantize runs on the CPU only in this version of lanes")
    if placement.device.type != "cpu":
        return False
    from .quant.native import built, unavailable_reason

    if not built():
        with Progress("building the CPU kernels (once a torch version)", 1, stream=stream, unit="step") as progress:
            unavailable_reason()
            progress.advance()
    reason = unavailable_reason()
    if quantize is None and checkpoint.gguf is None:
        return False  # full precision: nothing to keep quantized
    if reason is not None and quantize is not None:
        raise QuantizeRefused(f"--quantize needs the quantized CPU kernels: {reason}")
    if reason is not None:
        stream.write(f"GGUF weights are dequantized at load: {reason}\n")
    return reason is None


def load_action(checkpoint: Checkpoint, placement: Placement, quantize: str | None, kept: bool) -> str:
    """What the load does to the weights, in a few words for its progress bar."""
    dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(placement.dtype, str(placement.dtype))
    if quantize is not None:
        return f"quantizing matrices to {quantize} ({SCHEMES[quantize].name})"
    if checkpoint.gguf is not None:
        return "keeping GGUF blocks as they are" if kept else f"dequantizing to {dtype}"
    return f"in {dtype}"


def load_vision_tower(checkpoint: Checkpoint, placement: Placement, stream) -> "VisionTower":
    """The checkpoint's vision tower on the device (in the model's dtype), with a progress bar."""
    from .families.vision_tower import VisionTower, vision_tensor_count
    from .families.vision_tower_config import vision_config

    if checkpoint.config.family not in VISION_FAMILIES:
        raise CheckpointError(checkpoint.path, f"the {checkpoint.config.family} family takes no images or videos "
                                               f"(vision families: {', '.join(VISION_FAMILIES)})")
    try:
        config = vision_config(checkpoint.raw_config, checkpoint.config.family)
    except ConfigFault as error:
        raise CheckpointError(checkpoint.path, str(error)) from None
    with Progress("loading the vision tower", vision_tensor_count(config), stream=stream, unit="tensors") as progress:
        return VisionTower.load(config, checkpoint.source, checkpoint.path, device=placement.device,
                                dtype=placement.dtype, progress=progress)
