"""`python -m lanes`: serve (the API), generate (a greedy continuation), fetch (the default model)."""

from __future__ import annotations

import argparse
import sys

from .checkpoint.errors import CheckpointError
from .flags import add_serve_flags
from .models import DEFAULT_MODEL, resolve_model


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lanes", description="An LLM inference server on Trio.")
    commands = top.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="print a greedy continuation of a prompt",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--model", default=DEFAULT_MODEL, help="a Hugging Face folder, a .gguf file or a default's name")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--chat", action="store_true", help="render the prompt as one user message through the chat template")
    gen.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    gen.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on the CPU), bf16, fp16 or fp32")
    gen.add_argument("--kv-cache", choices=["auto", "fp8"], default="auto", help="the KV cache's number format")

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_flags(serve)

    fetch = commands.add_parser("fetch", help="download a default model into the cache (LANES_HOME or ~/.cache/lanes)")
    fetch.add_argument("--model", default=DEFAULT_MODEL)
    return top


async def _generate(args: argparse.Namespace) -> None:
    from .generate import greedy
    from .gpu.device import choose, runner_for
    from .loader import load_model

    placement = choose(args.device, args.dtype)
    model = load_model(resolve_model(args.model), placement, kv_bytes=64 << 20, kv_cache=args.kv_cache)
    tokenizer = model.tokenizer
    if args.chat:
        prompt = tokenizer.encode_prompt(tokenizer.render_chat([{"role": "user", "content": args.prompt}]))
    else:
        prompt = tokenizer.encode(args.prompt)
    runner = runner_for(placement)
    detok = tokenizer.detokenizer(prompt)
    try:
        async for token in greedy(model, runner, prompt, args.max_tokens):
            if token not in tokenizer.eos_ids:
                sys.stdout.write(detok.push(token))
                sys.stdout.flush()
        sys.stdout.write(detok.flush() + "\n")
    finally:
        runner.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    import trio  # after the parse: --help and bad flags answer without the engine's imports

    from .core.stream import BackendFailed
    from .gpu.device import DeviceError
    from .gpu.ranks import PeerLost, RankError
    from .serve import NotAvailable, configure_logging, refuse_unbuilt, serve_main
    from .loader import QuantizeRefused
    from .text.chat import ChatTemplateError

    usage = (CheckpointError, DeviceError, ChatTemplateError, NotAvailable, RankError, QuantizeRefused)
    failures = (BackendFailed, PeerLost)
    try:
        if args.command == "fetch":
            print(resolve_model(args.model))
        elif args.command == "generate":
            trio.run(_generate, args)
        elif args.command == "serve":
            configure_logging(args.log_level)
            refuse_unbuilt(args)
            return serve_main(args, argv)
    except usage as error:
        print(f"lanes: error: {error}", file=sys.stderr)
        return 2
    except failures as error:
        print(f"lanes: error: {error}", file=sys.stderr)
        return 1
    except BaseExceptionGroup as group:  # from inside the runtime's nursery
        found, _ = group.split(failures)
        if found is None:
            raise
        print(f"lanes: error: {first_leaf(found)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group
