"""`lanes serve`'s flags, in a module that imports nothing heavy, so that `--help` answers at once."""

from __future__ import annotations

import argparse

from .models import DEFAULT_MODEL


def count(text: str) -> int:
    """A whole number from 0 to 64 (processes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 64")
    return value


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face folder, a .gguf file or a default's name")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    parser.add_argument("--lanes", type=int, default=8, help="streams decoded together")
    parser.add_argument("--max-rows", type=int, default=256, help="prompt rows a pass may carry")
    parser.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a lane (then 429)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="most tokens of context a request may use")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on the CPU), bf16, fp16 or fp32")
    parser.add_argument("--kv-cache", choices=["auto", "fp8"], default="auto",
                        help="the KV cache's number format: auto (the model's dtype) or fp8 (e4m3 with a power-of-two "
                             "scale a token's head: half of bf16's bytes, a quarter of fp32's)")
    parser.add_argument("--quantize", choices=["int8", "int4"], default=None,
                        help="keep a full-precision checkpoint's matrices quantized on the CPU: int8 (GGUF Q8_0) or int4 "
                             "(Q4_1), scales a group of 32 (a GGUF file keeps its own types without it)")
    parser.add_argument("--prompt-cache-bytes", type=int, default=-1,
                        help="KV bytes the prompt cache may hold (-1: half the KV pool; 0: no prompt cache)")
    parser.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs (eager kernels)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take, queue included")
    parser.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds live streams get to finish at shutdown")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (with --tp)")
    parser.add_argument("--master", default=None, help="rank 0's address (with --tp)")
    parser.add_argument("--master-port", type=int, default=None, help="rank 0's port for torch.distributed (with --tp)")
    parser.add_argument("--vision", action="store_true", help="accept image and video inputs")
    parser.add_argument("--vision-urls", action="store_true", help="fetch public HTTPS image URLs")
    parser.add_argument("--max-media-parts", type=int, default=16, help="images and videos one request may carry (then 400)")
    parser.add_argument("--media-decode-bytes", type=int, default=4 << 30,
                        help="memory the server's image and video decoding may hold at once; a part costing more gets 400")
    parser.add_argument("--draft", choices=["ngram", "suffix", "model"], default=None,
                        help="speculative drafts: n-grams of a stream's own context, a suffix index of it and of recent "
                             "outputs, or a draft model (--draft-model)")
    parser.add_argument("--draft-model", default=None, help="a small model with the same tokenizer that drafts")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="most draft tokens a lane a pass (default: 16 on the CPU, where rows are cheap until the "
                             "cores' fma rate binds; 4 on CUDA, where it sizes the captured graphs)")
    parser.add_argument("--draft-lengths", choices=["load", "fixed"], default="load",
                        help="load: each lane's draft as long as it pays, by its acceptance and the passes' cost; "
                             "fixed: every lane drafts --draft-tokens each pass (to measure acceptance)")
    parser.add_argument("--decider", action="store_true", help="serve /v1/decisions and /v1/systemone")
    parser.add_argument("--decision-timeout", type=float, default=30.0, help="seconds a decision may take, queue included")
    parser.add_argument("--max-decisions", type=int, default=64, help="decisions that may wait (then 429)")
    parser.add_argument("--tool-system", default=None, help="system prompt file put before requests that carry tools")
    parser.add_argument("--max-open", type=int, default=1024, help="generation and decision requests open at once (then 429)")
    parser.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (then 408)")
    parser.add_argument("--send-timeout", type=float, default=30.0,
                        help="seconds a response write may make no progress before its request is ended")
    parser.add_argument("--keep-alive-timeout", type=float, default=30.0,
                        help="seconds an idle kept-alive connection waits for its next request")
    parser.add_argument("--send-buffer", type=int, default=None,
                        help="bytes of kernel send buffer a connection (SO_SNDBUF; default: the kernel's autotuning)")
    parser.add_argument("--stream-writers", type=count, default=0,
                        help="processes that write streamed answers to the clients' sockets, one message a pass "
                             "each, off the lane core's event loop (0: the event loop writes them)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
