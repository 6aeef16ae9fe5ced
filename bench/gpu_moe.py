"""MoE on the GPU: a Qwen3-30B-A3B-shaped model served by our engine beside transformers' generate(), in one run.

    python bench/gpu_moe.py [--streams 1,16,64] [--prompt 128] [--new 64] [--layers 48] [--experts-implementation X] [--dry]

Qwen3-30B-A3B's shape (hidden 2048, 48 layers, 128 experts with 8 a token, expert intermediate 768, 32 query
and 4 KV heads of 128, vocabulary 151936) with random bf16 weights from a fixed seed, built on the GPU by
transformers (no download, nothing written to disk: our engine reads the same tensors in memory, its
experts in lanes' stacked layout). Greedy, end-of-sequence ignored. Contenders: our engine (the decode
step in CUDA graphs when the MoE block is graph-safe: torch's fused grouped product; and eager), and
transformers' generate() on a static batch (its experts implementation as it chooses, or as asked). The
floor: the weight bytes a decode step must read (everything but the experts, plus the experts that n
streams' tokens pick, expected over uniform routing) over the copy bandwidth measured here. Prints one
table, and where the step is captured, one decode step's graph replay and whole pass beside its floor. --layers shrinks the model; --dry runs a tiny config on the CPU (a check of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio

from gpu import run_engine, say, step_times  # bench/gpu.py: streams through the lane core, one step's times

SHAPE = dict(hidden_size=2048, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
             intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
             max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6, norm_topk_prob=True,
             tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
DRY = dict(SHAPE, hidden_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)


class MemorySource:
    """A transformers model's tensors as a lanes TensorSource under the names a Hugging Face folder uses,
    the experts stacked per projection (views of transformers' fused gate_up_proj, no copies)."""

    def __init__(self, model, inter: int) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.experts.gate_up_proj"):
                stem = name[: -len("gate_up_proj")]
                self.tensors[stem + "gate_proj.weight"] = tensor[:, :inter]
                self.tensors[stem + "up_proj.weight"] = tensor[:, inter:]
            elif name.endswith("mlp.experts.down_proj"):
                self.tensors[name + ".weight"] = tensor
            else:
                self.tensors[name] = tensor

    def names(self):
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str, *, dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor if dim is None else tensor.chunk(world, dim)[rank]


def build_reference(shape: dict, device: str, dtype: torch.dtype, experts_implementation: str | None):
    """transformers' model with random weights from seed 0, built on the device in `dtype`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    config = Qwen3MoeConfig(**shape, **options)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: fp32 first would need twice the memory
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model, config


def ours(reference, config, folder: Path, placement, streams: int, context: int):
    """Our LoadedModel over the reference's tensors (read in place; the experts' gate and up stacked anew)."""
    from tokenizers import Tokenizer, models

    from lanes.core.blocks import BLOCK_SIZE, blocks_for
    from lanes.families.decoder import Decoder
    from lanes.families.layers import load_decoder, tensor_count
    from lanes.families.registry import family_for
    from lanes.families.weights import Shard
    from lanes.gpu.collective import Solo
    from lanes.gpu.kv import KVCache, KVShape
    from lanes.loader import Checkpoint, LoadedModel
    from lanes.progress import Progress

    raw = json.loads(config.to_json_string())
    (folder / "config.json").write_text(json.dumps(raw))
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    family = family_for(raw)
    mconfig = family.config(raw)
    source = MemorySource(reference, config.moe_intermediate_size)
    checkpoint = Checkpoint(folder, raw, mconfig, family, source)
    with Progress("reading the model into lanes", tensor_count(mconfig), unit="tensors") as progress:
        weights = load_decoder(mconfig, source, folder, shard=Shard(), device=placement.device, dtype=placement.dtype,
                               experts=family.experts, comm=Solo(), progress=progress)
    source.tensors.clear()  # what lanes did not take over in place is freed with the reference
    shape = KVShape(mconfig.layers, mconfig.kv_heads, mconfig.head_dim, BLOCK_SIZE)
    kv = KVCache(shape, streams * blocks_for(context + 1) + 16, device=placement.device, dtype=placement.dtype)
    decoder = Decoder(mconfig, weights, kv, Solo(), Shard())
    return LoadedModel(checkpoint, mconfig, checkpoint.tokenizer(), decoder, placement, Shard())


def run_generate(model, prompts, new: int, device: str) -> tuple[float, float]:
    """(tokens/s, time to the first token) of generate() on a static batch, greedy, after a warm-up."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

    def go(tokens: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - start

    go(2)
    ttft = go(1)
    return len(prompts) * new / go(new), ttft


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read plus written a second by a large copy on the device (median of 10)."""
    src = torch.randn(1 << (29 if device == "cuda" else 24), device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        sync(device)
        began = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - began)
    return 2 * src.numel() * 2 / statistics.median(times[2:])


def step_bytes(config, streams: int) -> tuple[float, float]:
    """(bytes a decode step of `streams` tokens reads: all but the experts, plus the experts expected to be
    picked under uniform routing; the active bytes of one token)."""
    e, k, h, i = config.num_experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size
    expert = 3 * h * i * 2  # gate, up and down in bf16
    layers = config.num_hidden_layers
    attention = (h * config.head_dim * (config.num_attention_heads * 2 + config.num_key_value_heads * 2) + h * e) * 2
    head = config.vocab_size * h * 2
    distinct = e * (1 - (1 - k / e) ** streams)
    return layers * (attention + distinct * expert) + head, layers * (attention + k * expert) + head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model's 48")
    parser.add_argument("--experts-implementation", default=None, help="transformers' experts implementation (default: its choice)")
    parser.add_argument("--dry", action="store_true", help="a tiny config on the CPU, fp32")
    args = parser.parse_args()
    from lanes.backend.torch_backend import TorchBackend
    from lanes.gpu.device import choose, runner_for
    from lanes.heap import freeze_startup_heap

    if not args.dry and not torch.cuda.is_available():
        print("bench/gpu_moe.py: no CUDA device (use --dry for a check on the CPU)")
        return
    device, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    shape = dict(DRY if args.dry else SHAPE)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    counts = [int(n) for n in args.streams.split(",")]
    most, context = max(counts), args.prompt + args.new
    rows: list[tuple[str, int, float, float]] = []
    steps: list[tuple[int, float, float]] = []  # (lanes, graph replay s, whole pass s)

    def measure(name: str, n: int, run) -> None:
        say(f"{name}, {n} streams ...")
        try:
            rate, ttft = run()
        except Exception as error:  # a contender that fails is reported, and the table still prints
            say(f"{name} at {n} failed: {type(error).__name__}: {error}")
            rows.append((name + " FAILED", n, float("nan"), float("nan")))
            return
        rows.append((name, n, rate, ttft))
        say(f"  {rate:.0f} tok/s, ttft {ttft * 1e3:.1f} ms")

    say("building the model ...")
    reference, config = build_reference(shape, device, dtype, args.experts_implementation)
    implementation = getattr(config, "_experts_implementation", None) or getattr(config, "experts_implementation", None)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (most, args.prompt), generator=generator).tolist()
    with torch.no_grad():
        for n in counts:
            measure("generate()", n, lambda: run_generate(reference, prompts[:n], args.new, device))
    with tempfile.TemporaryDirectory() as tmp:
        placement = choose(device, "fp32" if args.dry else "bf16")
        model = ours(reference, config, Path(tmp), placement, most, context + 16)
        del reference  # what our engine did not take over (the experts' fused gate_up) is freed
        if device == "cuda":
            torch.cuda.empty_cache()
        graph_safe = model.decoder.graph_safe
        for graphs in ((True, False) if device == "cuda" else (False,)):
            name = "lanes" + ("" if graphs else " (eager)") + ("" if graphs and graph_safe else " (uncaptured)" if graphs else "")
            try:
                backend = TorchBackend(model, runner_for(placement), lanes=most, max_model_len=context + 16, graphs=graphs)
            except Exception as error:
                say(f"{name}: the backend failed: {type(error).__name__}: {error}")
                rows.append((name + " FAILED", most, float("nan"), float("nan")))
                continue
            freeze_startup_heap()
            trio.run(run_engine, backend, model, prompts[:2], 4)  # warm-up
            for n in counts:
                measure(name, n, lambda: trio.run(run_engine, backend, model, prompts[:n], args.new))
            if graphs and graph_safe:
                for n in counts:
                    try:
                        steps.append((n, *step_times(backend, n, args.prompt + args.new // 2)))
                    except Exception as error:
                        say(f"one decode step at {n} failed: {type(error).__name__}: {error}")
            del backend
    bandwidth = copy_bandwidth(device)
    _, active = step_bytes(config, 1)
    where = "CPU (dry run)" if args.dry else torch.cuda.get_device_name()
    print(f"\nQwen3-30B-A3B shape ({shape['num_hidden_layers']} layers, {shape['num_experts']} experts, "
          f"{shape['num_experts_per_tok']} a token), {dtype}, {where}, prompt {args.prompt}, new {args.new}, greedy")
    print(f"active weights {active / 1e9:.2f} GB a token, copy bandwidth {bandwidth / 1e12:.2f} TB/s; transformers' experts: "
          f"{implementation}; our decode step {'captured in CUDA graphs' if graph_safe and device == 'cuda' else 'uncaptured'}")
    print(f"{'contender':<22} {'streams':>7} {'tok/s':>9} {'ttft ms':>8} {'x generate()':>12} {'of floor':>8}")
    generate = {n: r for name, n, r, _ in rows if name == "generate()"}
    floors = {n: n / (step_bytes(config, n)[0] / bandwidth) for n in counts}
    for name, n, rate, ttft in rows:
        gen = f"{rate / generate[n]:.2f}" if n in generate and name.startswith("lanes") else ""
        print(f"{name:<22} {n:>7} {rate:>9.0f} {ttft * 1e3:>8.1f} {gen:>12} {rate / floors[n]:>8.2f}")
    for n in counts:
        print(f"{'floor':<22} {n:>7} {floors[n]:>9.0f}")
    if steps:
        print(f"\n{'one decode step':<22} {'lanes':>7} {'graph ms':>9} {'pass ms':>8} {'floor ms':>9}")
        for n, replay, whole in steps:
            print(f"{'':<22} {n:>7} {replay * 1e3:>9.3f} {whole * 1e3:>8.3f} {step_bytes(config, n)[0] / bandwidth * 1e3:>9.3f}")


if __name__ == "__main__":
    main()
