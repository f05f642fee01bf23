"""Decode step time on a GPU, ours vs HF generate vs the bandwidth floor, and forward occupancy.

    python -m bench.gpu_bench [--shapes llama-3.2-1b,llama-3.1-8b] [--batch-sizes 1,16,64]
        [--prompt-len 128] [--new-tokens 32] [--device cuda] [--out-json FILE]
        [--attention-backend batched|triton] [--cuda-graph]

For each shape a random-weight bf16 checkpoint of that architecture is built on the device (no
downloads) and saved to a temporary folder our loader reads. Per batch size B, greedy, EOS ignored,
the same random prompt of --prompt-len tokens for every request:
  - HF: `generate` on a [B, P] batch; step time = (time(N) - time(1)) / (N - 1).
  - ours: the decode scheduler with in-process prefill (bench.serving_bench.bench_inprocess), overlap
    on and off; step time = the median gap between a request's tokens. With CUDA, a profiler over
    the run gives the device's kernel time; occupancy = kernel time / the decode phase's wall time.
  - floor: (weight bytes + KV bytes read per step) / the device copy bandwidth measured here.
`--shapes tiny --device cpu` runs every path on a tiny model (tests use it; no occupancy on CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import torch

SHAPES = {  # the public configurations' shapes (weights are random)
    "llama-3.2-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        tie_word_embeddings=False,
    ),
}


def build_checkpoint(shape: str, device: str, dtype: torch.dtype, out: str):
    """A random-weight Llama of `shape`, made on `device`, saved to `out`; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SHAPES[shape], max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    return model


def bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    _sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def hf_step_ms(model, prompt: list[int], batch: int, new_tokens: int, device: str) -> float:
    ids = torch.tensor([prompt] * batch, device=device)

    def run(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
        _sync(device)
        return time.perf_counter() - start

    run(2)
    return 1e3 * (run(new_tokens) - run(1)) / (new_tokens - 1)


def load_runners(
    path: str,
    max_batch: int,
    tokens_per_request: int,
    device: str,
    dtype: str,
    backend: str = "batched",
    graphs=False,
    fused: str = "on",
) -> tuple:
    """(decode, prefill) ModelRunners sized for the largest batch, loaded once per shape; the decode
    runner captures its CUDA graphs when `graphs` (needs the triton backend). `fused`: the fused CUDA
    ops (common/models/cuda_fused.py) "on", "off", or "cublas" (on, but the warm-up's tuning offered
    no GEMV config, so every linear stays on cuBLAS)."""
    from common.engine.model_runner import ModelRunner, RunnerArgs
    from common.models import cuda_gemv

    args = dict(
        device=device,
        dtype=dtype,
        max_running_requests=max_batch,
        max_total_tokens=max_batch * tokens_per_request + 64,
        attention_backend=backend,
        cuda_fused=fused != "off",
    )
    decode = ModelRunner(RunnerArgs(path, cuda_graph=graphs, **args))
    configs = dict(cuda_gemv.CONFIGS)
    if fused == "cublas":
        cuda_gemv.CONFIGS.clear()
    try:
        decode.warmup()
    finally:
        cuda_gemv.CONFIGS.update(configs)
    return decode, ModelRunner(RunnerArgs(path, **args))


def ours(runners: tuple, prompt: list[int], batch: int, new_tokens: int, device: str, overlap: bool) -> dict:
    """Our step time (median inter-token gap) and, on CUDA, occupancy of the device."""
    from bench.serving_bench import bench_inprocess

    run = lambda: bench_inprocess("", prompt, batch, new_tokens, overlap=overlap, runners=runners)  # noqa: E731
    if torch.device(device).type != "cuda":
        r = run()
        return dict(step_ms=r["itl_p50_ms"], occupancy=None)
    from torch.profiler import ProfilerActivity, profile

    run()  # warm-up (allocator, kernels)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        r = run()
        wall = time.perf_counter() - start
    kernel_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    return dict(step_ms=r["itl_p50_ms"], occupancy=min(1.0, kernel_s / wall))


def floor_ms(model, batch: int, ctx: int, bw: float) -> float:
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = batch * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
    return 1e3 * (weights + kv) / bw


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out-json", default=None)
    p.add_argument("--attention-backend", default="batched", help="batched | triton | torch")
    p.add_argument("--cuda-graph", action="store_true", help="decode steps replay CUDA graphs (with triton)")
    p.add_argument(
        "--fused",
        default="on",
        help="the fused CUDA ops, each of a comma list on the same checkpoint: on | cublas (the fused ops, every "
        "linear through cuBLAS: no GEMV) | off",
    )
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (its figures do not change with ours)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bw = bandwidth(args.device, 1 << 30 if args.device == "cuda" else 1 << 26)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"# {name}, copy bandwidth {bw / 1e9:.0f} GB/s, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{args.dtype}, attention {args.attention_backend}, CUDA graphs {'on' if args.cuda_graph else 'off'}",
        flush=True,
    )
    print(
        "| shape | fused | B | HF ms/step | ours ms/step (overlap) | ours ms/step (no overlap) | floor ms | "
        "occupancy on / off |\n| --- | --- | --- | --- | --- | --- | --- | --- |",
        flush=True,
    )
    rows = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as folder:
            model = build_checkpoint(shape, args.device, dtype, folder)
            vocab = SHAPES[shape]["vocab_size"]
            prompt = [(1000003 * i + 7) % (vocab - 3) + 3 for i in range(args.prompt_len)]
            batches = [int(x) for x in args.batch_sizes.split(",")]
            hf = {
                b: None if args.no_hf else hf_step_ms(model, prompt, b, args.new_tokens, args.device) for b in batches
            }
            for fused in args.fused.split(","):
                runners = load_runners(
                    folder,
                    max(batches),
                    args.prompt_len + args.new_tokens,
                    args.device,
                    args.dtype,
                    args.attention_backend,
                    args.cuda_graph,
                    fused,
                )
                rows += _rows(runners, model, prompt, batches, hf, shape, fused, args, bw, name)
                del runners
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            del model
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


def _rows(runners, model, prompt, batches, hf, shape, fused, args, bw, name) -> list[dict]:
    rows = []
    for b in batches:
        on = ours(runners, prompt, b, args.new_tokens, args.device, overlap=True)
        off = ours(runners, prompt, b, args.new_tokens, args.device, overlap=False)
        row = dict(
            shape=shape,
            fused=fused,
            batch=b,
            hf_ms=hf[b],
            ours_ms=on["step_ms"],
            ours_no_overlap_ms=off["step_ms"],
            floor_ms=floor_ms(model, b, args.prompt_len + args.new_tokens // 2, bw),
            occupancy=on["occupancy"],
            occupancy_no_overlap=off["occupancy"],
            device=name,
        )
        rows.append(row)
        occ = "-" if on["occupancy"] is None else f"{on['occupancy']:.0%} / {off['occupancy']:.0%}"
        hf_ms = "-" if hf[b] is None else f"{hf[b]:.2f}"
        print(
            f"| {shape} | {fused} | {b} | {hf_ms} | {on['step_ms']:.2f} | {off['step_ms']:.2f} | "
            f"{row['floor_ms']:.2f} | {occ} |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("common.models.cuda_gemv").setLevel(logging.INFO)  # each linear shape's kernel choice
    main()
