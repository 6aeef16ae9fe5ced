"""`python -m lanes serve`: load the model, build the lane core and the service, run until a signal."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import trio

from .core.lane_core import LaneCore
from .families.weights import Shard
from .core.metered import MeteredBackend
from .followers import Followers, FollowersBackend
from .gpu.ranks import RankSpec, join, leave, startup_barrier
from .launch import device_of, follower_main, kv_blocks, launched_followers, model_length, rank_spec
from .backend.torch_backend import TorchBackend, text_factory
from .grammar.engine import GrammarEngine
from .core.blocks import blocks_for
from .gpu.device import choose, runner_for
from .heap import freeze_startup_heap
from .http.service import Service
from .loader import load_model
from .models import DEFAULTS, resolve_model
from .runtime import Runtime, watch_signals

log = logging.getLogger("lanes.serve")

# Flags whose capability is not built yet: refused at start-up by name, never ignored.
NOT_YET: dict[str, str] = {}
MIN_DECODE_BYTES = 256 << 20


class NotAvailable(Exception):
    """A flag asks for something this version cannot do."""


def refuse_unbuilt(args: argparse.Namespace) -> None:
    if args.tp < 1:
        raise NotAvailable("--tp must be at least 1")
    for name, flag in NOT_YET.items():
        value = getattr(args, name)
        if value not in (None, False):
            raise NotAvailable(f"{flag} is not available in this version of lanes")
    if args.vision_urls and not args.vision:
        raise NotAvailable("--vision-urls needs --vision")
    if args.max_media_parts < 1:
        raise NotAvailable("--max-media-parts must be at least 1")
    if args.media_decode_bytes < MIN_DECODE_BYTES:
        raise NotAvailable(f"--media-decode-bytes must be at least {MIN_DECODE_BYTES} (reading a video's headers may take 140 MiB)")
    if args.draft_model is not None and args.draft not in (None, "model"):
        raise NotAvailable(f"--draft-model drafts with a model; it does not go with --draft {args.draft}")
    if args.draft == "model" and args.draft_model is None:
        raise NotAvailable("--draft model needs --draft-model PATH")
    if args.draft_tokens is not None and not 1 <= args.draft_tokens <= 16:
        raise NotAvailable("--draft-tokens must be between 1 and 16")
    if args.vision and args.tp > 1:
        # Followers would need every image's embeddings broadcast with the plans; not built.
        raise NotAvailable("--vision with --tp above 1 is not available in this version of lanes")


def build_service(args: argparse.Namespace, spec: RankSpec | None = None) -> Service:
    """Load the model (this rank's shard) and put the lane core and the service together (nothing runs yet)."""
    placement = choose(device_of(args, 0) if spec else args.device, args.dtype)
    path = resolve_model(args.model)
    followers = None
    if spec is None:
        # Enough KV for every lane to hold a whole context, if the budget allows.
        model = load_model(path, placement, kv_max_blocks=args.lanes * blocks_for(args.max_model_len), vision=args.vision,
                           kv_cache=args.kv_cache, quantize=args.quantize)
    else:
        comm, control = join(spec, placement.device)
        model = load_model(path, placement, shard=Shard(0, spec.world), comm=comm, kv_blocks=kv_blocks(args),
                           kv_cache=args.kv_cache, quantize=args.quantize)
        startup_barrier(0)
        followers = Followers(control, spec.world)
    max_model_len = model_length(args, model)
    # on the CPU rows are cheap until the cores' fma rate binds (docs/DECISIONS.md, "Drafts at one stream on a Zen 4")
    draft_tokens = args.draft_tokens if args.draft_tokens is not None else 4 if placement.is_cuda else 16
    # Several ranks run the fast decode step uncaptured: graphs would hold NCCL's per-call bookkeeping still.
    stop_ids = set(model.tokenizer.eos_ids) | set(model.config.eos_token_ids)
    grammars = GrammarEngine.for_tokenizer(model.tokenizer, model.config.vocab_size, stop_ids)
    grammars.warm()  # the grammar engine's tokenizer (~0.5 s for 49k tokens), before the first constrained request
    backend = TorchBackend(model, runner_for(placement), lanes=args.lanes, max_model_len=max_model_len,
                           graphs=not args.no_graphs, capture=spec is None, grammars=grammars.matcher,
                           draft_tokens=draft_tokens if args.draft or args.draft_model else 0)
    if followers is not None:
        backend = FollowersBackend(backend, followers)
    backend = MeteredBackend(backend)  # pass times for /metrics
    shape = backend.shape
    cache_bytes = shape.blocks * shape.bytes_per_block // 2 if args.prompt_cache_bytes < 0 else args.prompt_cache_bytes
    drafts, method = draft_source(args, model, placement)
    core = LaneCore(backend, text_factory(model.tokenizer), stop_ids, max_rows=args.max_rows, max_queue=args.max_queue,
                    cache_bytes=cache_bytes, max_decisions=args.max_decisions, drafts=drafts,
                    draft_tokens=draft_tokens, draft_control=args.draft_lengths == "load")
    tool_system = None
    if args.tool_system is not None:
        from .http.tool_system import ToolSystem

        if model.tokenizer.chat_template is None:
            raise NotAvailable("--tool-system needs a model with a chat template")
        try:
            tool_system = ToolSystem.load(Path(args.tool_system), model.tokenizer)
        except OSError as error:
            raise NotAvailable(f"--tool-system {args.tool_system}: {error.strerror}") from None
    name = args.model if args.model.lower() in DEFAULTS else Path(args.model).name
    return Service(core, model.tokenizer, name, model.config.family, max_model_len, vocab_size=model.config.vocab_size,
                   request_timeout=args.request_timeout, api_key=args.api_key, tool_system=tool_system,
                   decides=args.decider, decision_timeout=args.decision_timeout, max_open=args.max_open,
                   body_timeout=args.body_timeout, send_timeout=args.send_timeout, idle_timeout=args.keep_alive_timeout,
                   send_buffer=args.send_buffer, stream_writers=args.stream_writers,
                   tp=spec.world if spec else 1, followers=followers,
                   vision=args.vision, vision_inputs=vision_inputs(model, args) if args.vision else None,
                   pass_times=backend.statistics, draft_method=method,
                   draft_tokens=draft_tokens if drafts is not None else 0,
                   grammars=grammars, kv_cache=model.decoder.kv.describe(), weights=model.weights_census().as_json())


def draft_source(args: argparse.Namespace, model, placement):
    """The drafts `--draft` and `--draft-model` ask for, and the method's name for /v1/info (or None, None)."""
    if args.draft_model is not None:
        from .drafts.model import DraftModel

        draft = load_model(resolve_model(args.draft_model), placement,
                           kv_max_blocks=args.lanes * blocks_for(args.max_model_len), kv_cache=args.kv_cache)
        if not draft.tokenizer.same_as(model.tokenizer) or draft.config.vocab_size != model.config.vocab_size:
            raise NotAvailable(f"--draft-model {args.draft_model}: its tokenizer is not the served model's")
        return DraftModel(draft), "model"
    if args.draft == "ngram":
        from .drafts.ngram import NgramDrafter

        return NgramDrafter(), "ngram"
    if args.draft == "suffix":
        from .drafts.suffix import SuffixDrafter

        return SuffixDrafter(), "suffix"
    return None, None


def vision_inputs(model, args: argparse.Namespace):
    """How this server turns image and video parts into media: the model folder's processor settings, the
    flags' bounds and the server's one decode gate."""
    import json

    from .http.decode_gate import DecodeGate
    from .http.media_fetch import MediaFetcher
    from .http.vision_inputs import VisionInputs
    from .vision.qwen_image import VisionParams

    def read(name: str) -> dict | None:
        path = model.checkpoint.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    image = read("preprocessor_config.json") or {}
    video = read("video_preprocessor_config.json")
    try:
        return VisionInputs(MediaFetcher(allow_urls=args.vision_urls), model.vision_tokens,
                            image=VisionParams.from_preprocessor_config(image),
                            video=VisionParams.from_preprocessor_config(video if video is not None else image, video=True),
                            max_parts=args.max_media_parts, gate=DecodeGate(args.media_decode_bytes))
    except ValueError as error:
        raise NotAvailable(f"--vision: the model's preprocessor config: {error}") from None


async def serve(args: argparse.Namespace, spec: RankSpec | None = None) -> None:
    service = build_service(args, spec)
    log.debug("start-up done: %d objects kept out of the garbage collector's full collections", freeze_startup_heap())
    runtime = Runtime(service, host=args.host, port=args.port, grace=args.shutdown_grace)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals, runtime)
            await runtime.run()
            nursery.cancel_scope.cancel()
    finally:
        if spec is not None:
            leave()


def serve_main(args: argparse.Namespace, argv: list[str]) -> int:
    """Every shape of `lanes serve`: one rank, rank 0 of several, a follower, or the launcher of them all."""
    if args.tp > 1 and args.rank is None:
        with launched_followers(args, argv) as rank0:
            trio.run(serve, rank0, rank_spec(rank0))
        return 0
    spec = rank_spec(args)
    if spec is not None and spec.rank > 0:
        return follower_main(args)
    trio.run(serve, args, spec)
    return 0


def configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
