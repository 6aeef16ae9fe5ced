"""The C++ kernels, compiled on first use with the machine's C++ compiler, cached under
`$LANES_HOME/kernels`, and loaded as the torch ops `torch.ops.lanes_quant.*` (fake versions registered, so
torch.compile can trace through them). Two sets:
- fp32 (cpu_attention.cpp: paged attention; cpu_activation.cpp: the gated MLP's silu; cpu_norm.cpp: RMSNorm;
  cpu_rope.cpp: rotary embeddings; cpu_softmax.cpp: log-softmax and greedy draws; cpu_dense.cpp: fp32
  products of few rows): written over 16 lanes (cpu_vec.h), built for AVX-512 or for AVX2 with FMA;
- quantized (gguf_kernels.cpp: products over GGUF blocks; int8_kernels.cpp: the 32-value formats' products
  in integers): AVX-512 with VNNI only; elsewhere GGUF weights are dequantized at load.
`available()` says whether the fp32 set runs here, `unavailable_reason()` why the quantized one does not."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).parent
FP32_SOURCES = [HERE / n for n in ("cpu_attention.cpp", "cpu_activation.cpp", "cpu_norm.cpp", "cpu_rope.cpp",
                                   "cpu_softmax.cpp", "cpu_dense.cpp")]
QUANT_SOURCES = [HERE / n for n in ("gguf_kernels.cpp", "int8_kernels.cpp")]
HEADERS = [HERE / n for n in ("gguf_formats.h", "int8_chunks.h", "cpu_math.h", "cpu_vec.h", "cpu_pool.h", "cpu_rows.h")]
AVX512 = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
VNNI = ["-mavx512vnni"]
# only the kernels' explicit fmas fuse: an AVX2 multiply and add are separate intrinsics GCC would contract
AVX2 = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-ffp-contract=off"]


class KernelsUnavailable(RuntimeError):
    """The kernels cannot run here; the message says why in one line."""


@dataclass(frozen=True)
class _Built:
    ops: object | None  # torch.ops.lanes_quant, or None when nothing could be built
    quantized: bool  # the quantized set is among them
    reason: str | None  # why the quantized set is not (None when it is)
    flavor: str = ""  # "avx512" (with the quantized set), "avx512-fp32" or "avx2"


def kernels():
    """`torch.ops.lanes_quant`, built the first time; raises KernelsUnavailable when no set can be (the
    first failure is kept: no second build is tried in this process)."""
    built = _load()
    if built.ops is None:
        raise KernelsUnavailable(built.reason)
    return built.ops


@functools.cache
def _load() -> _Built:
    """What this process could build, once."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and torch.cpu._is_vnni_supported():
        sources, flags, name, reason = FP32_SOURCES + QUANT_SOURCES, AVX512 + VNNI, "avx512", None
    elif capability == "AVX512":
        sources, flags, name = FP32_SOURCES, AVX512, "avx512-fp32"
        reason = "this CPU has AVX-512 but not its VNNI integer dot products"
    elif capability == "AVX2":
        sources, flags, name = FP32_SOURCES, AVX2, "avx2"
        reason = f"this CPU has no AVX-512 (torch sees {capability})"
    else:
        return _Built(None, False, f"this CPU has neither AVX-512 nor AVX2 (torch sees {capability})")
    quantized = reason is None
    try:
        return _Built(_build(sources, flags, name, quantized), quantized, reason, name)
    except KernelsUnavailable as error:
        return _Built(None, False, str(error))


def _build(sources: list[Path], flags: list[str], name: str, quantized: bool):
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelsUnavailable(f"no C++ compiler ({compiler}) to build them with")
    from torch.utils.cpp_extension import load

    from ..models import lanes_home

    build = lanes_home() / "kernels" / f"torch-{torch.__version__}-{name}"
    build.mkdir(parents=True, exist_ok=True)
    # torch rebuilds when the sources or flags change; the header's digest in the flags covers it too
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    try:
        load("lanes_quant", [str(s) for s in sources], extra_cflags=[*flags, f"-DLANES_QUANT_HEADERS={digest}"],
             extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as error:
        raise KernelsUnavailable(f"building the kernels failed ({str(error).splitlines()[0]})") from None
    _register_fakes(quantized)
    return torch.ops.lanes_quant


def built() -> bool:
    """Whether this process has tried to load the kernels already (so asking again costs nothing)."""
    return _load.cache_info().currsize > 0


def unavailable_reason() -> str | None:
    """None when the quantized kernels load (building them if needed), else why not, in one line."""
    built = _load()
    return None if built.quantized else built.reason


def flavor() -> str:
    """Which build of the kernels runs here: "avx512", "avx512-fp32", "avx2", or "" (none)."""
    return _load().flavor


@functools.cache
def cpu_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"), or "" where it does not."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def available() -> bool:
    """Whether the fp32 kernels run here (built the first time asked): the CPU path's parts ask it before each op."""
    return _load().ops is not None


def _register_fakes(quantized: bool) -> None:
    @torch.library.register_fake("lanes_quant::mm_f32")
    def _(x, w, spread=False):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("lanes_quant::paged_attention")
    def _(q, cache_k, cache_v, key_slots, row_first, row_len, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("lanes_quant::rope_attention")
    def _(qkv, cos, sin, cache_k, cache_v, slots, key_slots, row_first, row_len, heads, scale):
        return qkv.new_empty((qkv.shape[0], heads * cache_k.shape[2]))

    @torch.library.register_fake("lanes_quant::silu_mul")
    def _(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @torch.library.register_fake("lanes_quant::rope")
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    @torch.library.register_fake("lanes_quant::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("lanes_quant::log_softmax")
    def _(logits):
        return torch.empty_like(logits)

    @torch.library.register_fake("lanes_quant::greedy")
    def _(logits):
        return logits.new_empty((2, logits.shape[0]), dtype=torch.float64)

    if not quantized:
        return

    @torch.library.register_fake("lanes_quant::mm_tiles")
    def _(x, w, kind, n, k):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("lanes_quant::mm_panels")
    def _(x, w, kind, n, k, panel):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("lanes_quant::mm_int8")
    def _(x, w, kind, n, k):
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("lanes_quant::take_int8")
    def _(w, ids, kind, n, k):
        return w.new_empty((ids.shape[0], k), dtype=torch.float32)

    @torch.library.register_fake("lanes_quant::take_rows")
    def _(w, ids, kind, n, k):
        return w.new_empty((ids.shape[0], k), dtype=torch.float32)
