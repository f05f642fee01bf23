"""Handoff throughput by KV chunk size, and TTFT split into queue / prefill compute / transfer.

    python -m bench.handoff_bench [--device cpu] [--prompt-len 480] [--chunk-kib 256,1024,4096,16384]
        [--backends grpc,mooncake]

A prefill service runs as a subprocess (its own process, as deployed); this process is the client.
1. Throughput: Prefill is called directly; GB/s = KV bytes / (record arrival - first-token arrival):
   server-side encoding, loopback transfer and client-side decoding into tensors; best of --repeats.
   With mooncake (the prefill subprocess runs --disaggregation-transfer-backend mooncake), this
   process plays decode: a KV pool registered with its own transfer engine, the call names slots in
   it (one contiguous run, as a fresh pool hands them out, or scattered runs of 16 slots, as a
   churned one may), and GB/s = KV bytes / (record
   arrival - first-token arrival) with every byte already in the pool.
2. TTFT: a decode service (in this process) with the prefill replica; a streaming Generate. Reported:
   queue and compute as the prefill service measured them, transfer = first token -> record on the
   decode side, the client's first token, and when the decode side had the whole handoff.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

import grpc
import torch

from common.models.config import load_model_config
from common.tools.procs import free_port, stop, wait_serving
from common.tools.tiny_checkpoint import build
from common.wire import kv_chunks
from common.wire.grpc_server import channel_options
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc


def throughput(address: str, prompt: list[int], chunk_bytes: int, cfg, repeats: int) -> tuple[float, int, int]:
    stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(address, options=channel_options()))
    best, total, count = 0.0, 0, 0
    for _ in range(repeats):
        assembler = kv_chunks.KvAssembler(len(prompt), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        first = None
        for msg in stub.Prefill(
            prefill_pb2.PrefillRequest(request_id="b", input_ids=prompt, max_chunk_bytes=chunk_bytes)
        ):
            if msg.WhichOneof("payload") == "first_token":
                first = time.perf_counter()
            elif msg.WhichOneof("payload") == "kv":
                assembler.add(msg.kv)
            elif msg.WhichOneof("payload") == "record":
                elapsed = time.perf_counter() - first
                assembler.finish()
                total = sum(t.numel() * t.element_size() for t in assembler.k + assembler.v)
                count = assembler.chunks
                best = max(best, total / elapsed / 1e9)
    return best, total, count


def throughput_mooncake(
    address: str,
    prompt: list[int],
    chunk_bytes: int,
    cfg,
    repeats: int,
    run: int = 0,
    pool_device: str = "cpu",
    dtype=torch.float32,
) -> tuple[float, int, int]:
    """`run`: the reserved slots come in scattered runs of this many (0: one contiguous run);
    `pool_device`: where decode's pool lives (cuda: the engine registers device memory, as a decode
    service on a GPU does)."""
    from common.kv_transfer import mooncake, plan

    engine = mooncake.TransferEngine()
    slots = 4 * len(prompt) + 1
    k = [
        torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, device=pool_device, dtype=dtype)
        for _ in range(cfg.num_layers)
    ]
    v = [
        torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, device=pool_device, dtype=dtype)
        for _ in range(cfg.num_layers)
    ]
    engine.register(k + v)
    if run:
        blocks = torch.randperm(slots // run - 1, generator=torch.Generator().manual_seed(0)) + 1
        order = [int(b) * run + j for b in blocks for j in range(run)][: len(prompt)]
    else:
        order = list(range(1, len(prompt) + 1))
    dest = prefill_pb2.KvDestination(session=engine.session, target=plan.kv_region(k, v))
    dest.runs.extend(plan.slot_runs(order))
    stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(address, options=channel_options()))
    best, total, count = 0.0, 0, 0
    for _ in range(repeats):
        first, count, total = None, 0, 0
        request = prefill_pb2.PrefillRequest(
            request_id="m", input_ids=prompt, max_chunk_bytes=chunk_bytes, kv_destination=dest
        )
        for msg in stub.Prefill(request):
            kind = msg.WhichOneof("payload")
            if kind == "first_token":
                first = time.perf_counter()
            elif kind == "written":
                count += 1
                total += msg.written.bytes
            elif kind == "record":
                best = max(best, total / (time.perf_counter() - first) / 1e9)
    if not any(t.abs().sum() > 0 for t in k):
        raise RuntimeError(f"mooncake reported {total} bytes written but the {pool_device} pool is still zero")
    engine.unregister(k + v)
    return best, total, count


def ttft(path: str, prefill_addr: str, prompt: list[int], device: str) -> dict:
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    from decode_service.config import DecodeConfig
    from decode_service.server import DecodeService

    decode = DecodeService(
        DecodeConfig(path, prefill_addr=prefill_addr, port=0, device=device, max_total_tokens=4096)
    ).start()
    marks: dict[str, float] = {}
    deliver = decode.scheduler.inbox.deliver_handoff
    decode.scheduler.inbox.deliver_handoff = lambda h: (
        marks.setdefault("handoff_done", time.perf_counter()),
        deliver(h),
    )
    first_token = decode.scheduler.inbox.deliver_first_token
    decode.scheduler.inbox.deliver_first_token = lambda *a: (
        marks.setdefault("first_at_decode", time.perf_counter()),
        first_token(*a),
    )
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        while not stub.HealthCheck(pb.HealthCheckRequest()).healthy:
            time.sleep(0.1)
        results = []
        for i in range(4):  # first run warms up
            marks.clear()
            start = time.perf_counter()
            call = stub.Generate(
                pb.GenerateRequest(
                    request_id=f"t{i}",
                    tokenized=pb.TokenizedInput(input_ids=prompt),
                    sampling_params=pb.SamplingParams(max_new_tokens=4),
                    stream=True,
                )
            )
            next(call)
            client_first = time.perf_counter()
            list(call)
            results.append(
                {
                    "client_ttft_ms": 1e3 * (client_first - start),
                    "handoff_done_ms": 1e3 * (marks["handoff_done"] - start),
                    "transfer_ms": 1e3 * (marks["handoff_done"] - marks["first_at_decode"]),
                }
            )
        return {k: min(r[k] for r in results[1:]) for k in results[1]}
    finally:
        decode.stop()


def server_split(address: str, prompt: list[int]) -> tuple[float, float]:
    stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(address, options=channel_options()))
    rec = [
        m.record
        for m in stub.Prefill(prefill_pb2.PrefillRequest(request_id="s", input_ids=prompt))
        if m.WhichOneof("payload") == "record"
    ][0]
    return rec.queue_us / 1e3, rec.compute_us / 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--prompt-len", type=int, default=480)
    parser.add_argument("--chunk-kib", default="256,1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="grpc,mooncake", help="data planes to measure")
    parser.add_argument("--pool-device", default="cpu", help="mooncake: decode's pool on this device (cpu | cuda)")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or build(tmp, "llama", hidden_size=512, num_layers=16)
        cfg = load_model_config(path)
        kv_dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # the prefill's --dtype auto
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefill_service",
                "--model-path",
                path,
                "--port",
                str(port),
                "--device",
                args.device,
                "--torch-threads",
                "1",
                "--max-total-tokens",
                "4096",
                "--disaggregation-transfer-backend",  # calls without a destination still get bytes
                "mooncake" if "mooncake" in backends else "grpc",
                "--disaggregation-network-private",  # loopback only
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        address = f"127.0.0.1:{port}"
        try:
            wait_serving(address, proc)
            prompt = [(13 * i) % (cfg.vocab_size - 10) + 5 for i in range(args.prompt_len)]
            print(
                f"model: hidden 512, 16 layers, {cfg.num_kv_heads} kv heads x {cfg.head_dim}; "
                f"prompt {len(prompt)} tokens"
            )
            print("| backend | chunk bound | chunks | KV bytes | GB/s (KV in decode's hands) |")
            print("| --- | --- | --- | --- | --- |")
            for kib in [int(x) for x in args.chunk_kib.split(",")]:
                if "grpc" in backends:
                    gbps, total, count = throughput(address, prompt, kib << 10, cfg, args.repeats)
                    print(f"| grpc | {kib} KiB | {count} | {total / 1e6:.1f} MB | {gbps:.2f} |", flush=True)
                for run in [0, 16] if "mooncake" in backends else []:
                    gbps, total, count = throughput_mooncake(
                        address, prompt, kib << 10, cfg, args.repeats, run, args.pool_device, kv_dtype
                    )
                    slots = f"{'runs of ' + str(run) if run else 'contiguous'}, {args.pool_device} pool"
                    print(
                        f"| mooncake, {slots} | {kib} KiB | {count} | {total / 1e6:.1f} MB | {gbps:.2f} |", flush=True
                    )
            queue_ms, compute_ms = server_split(address, prompt)
            t = ttft(path, address, prompt, args.device)
            print("\n| queue (ms) | prefill compute (ms) | transfer (ms) | client TTFT (ms) | handoff done (ms) |")
            print("| --- | --- | --- | --- | --- |")
            print(
                f"| {queue_ms:.1f} | {compute_ms:.1f} | {t['transfer_ms']:.1f} | {t['client_ttft_ms']:.1f} | "
                f"{t['handoff_done_ms']:.1f} |"
            )
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
