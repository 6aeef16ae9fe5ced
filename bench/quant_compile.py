"""The GPU quant kernels compiled for sm_90 on any machine (no GPU needed): registers, spills, tensor-core ops.

    python bench/quant_compile.py

Triton compiles each kernel of lanes.gpu.quant_kernels at the tiles lanes.gpu.quant picks (and the tensor-
core kernel's sweep in bench/gpu_quant.py) for an H200's sm_90 with its bundled ptxas; cuobjdump (also
bundled) reads each binary's registers and stack (spilled bytes) and counts HGMMA (wgmma) instructions.
Prints one table. Compiled code only: timings need the GPU (bench/gpu_quant.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from lanes.gpu import quant_kernels as qk

TOOL = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
GEMV = dict(x_ptr="*bf16", w_ptr="*u8", out_ptr="*bf16", M="i32", N="i32", K="i32", row_bytes="i32", stride_xm="i32",
            stride_os="i32", stride_om="i32", steps_per_split="i32", FMT="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr", SB="constexpr")
MM = dict(x_ptr="*bf16", w_ptr="*u8", out_ptr="*bf16", M="i32", N="i32", K="i32", row_bytes="i32", stride_xm="i32",
          stride_om="i32", FMT="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr", IEEE="constexpr")
DEQUANTIZE = dict(w_ptr="*u8", out_ptr="*bf16", N="i32", K="i32", row_bytes="i32", FMT="constexpr", BLOCK_N="constexpr")
NAMES = {qk.Q8_0: "Q8_0", qk.Q4_K: "Q4_K", qk.Q6_K: "Q6_K"}


def compiled(fn, signature: dict, constants: dict, **options) -> tuple[int, int, int]:
    """(registers, stack bytes, HGMMA instructions) of fn compiled for sm_90."""
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([TOOL, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([TOOL, "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return regs, stack, sass.count("HGMMA")


def main() -> None:
    rows = []
    for fmt, name in NAMES.items():
        for m, bn, sb in ((1, 1, 4), (1, 2, 4), (1, 4, 1), (1, 4, 2), (1, 2, 8), (1, 1, 8), (4, 2, 2), (8, 2, 1), (8, 4, 1)):
            rows.append((name, f"gemv m{m} n{bn} sb{sb} w4",
                         compiled(qk._gemv_kernel, GEMV, dict(FMT=fmt, BLOCK_M=m, BLOCK_N=bn, SB=sb), num_warps=4)))
        for bm, bn, w, st in ((16, 64, 8, 3), (32, 64, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2)):
            rows.append((name, f"mm m{bm} n{bn} w{w} s{st}",
                         compiled(qk._mm_kernel, MM, dict(FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, IEEE=False), num_warps=w, num_stages=st)))
        rows.append((name, "dequantize n16 w4", compiled(qk._dequantize_kernel, DEQUANTIZE, dict(FMT=fmt, BLOCK_N=16), num_warps=4)))
    print(f"lanes.gpu.quant_kernels compiled for sm_90, Triton {triton.__version__}")
    print(f"{'format':6} {'kernel and tile':24} {'regs':>5} {'stack B':>8} {'HGMMA':>6}")
    for name, what, (regs, stack, hgmma) in rows:
        print(f"{name:6} {what:24} {regs:>5} {stack:>8} {hgmma:>6}")


if __name__ == "__main__":
    main()
