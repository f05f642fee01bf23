"""bench.load_gen: a short run against the gRPC pair reports every request and sane latencies."""

from __future__ import annotations

import json

import pytest

from bench import load_gen
from tests.grpc_harness import GrpcPair


def test_report_arithmetic():
    outcomes = [
        load_gen.Outcome(
            ok=True,
            ttft=0.1,
            e2e=1.1,
            itls=[0.1] * 10,
            prompt_tokens=5,
            output_tokens=11,
            spec_accepted=6,
            spec_drafted=12,
        ),
        load_gen.Outcome(ok=False, error="UNAVAILABLE: x"),
    ]
    r = load_gen.report(outcomes, 2.0, num_steps=3)
    assert (r["completed"], r["failed"]) == (1, 1) and r["errors"] == ["UNAVAILABLE: x"]
    assert r["output_throughput"] == pytest.approx(5.5) and r["mean_tpot_ms"] == pytest.approx(100.0)
    assert r["accept_length"] == pytest.approx(2.5)  # 12 drafted / 3 = 4 verify steps, 6 accepted
    assert r["total_input_tokens"] == 5 and r["p99_itl_ms"] == pytest.approx(100.0) and r["std_itl_ms"] < 1e-9
    # SGLang bench_serving's flat keys, so its tooling reads our reports
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_e2e_latency_ms"):
        assert isinstance(r[key], float), key


def test_grpc_run_with_poisson_arrivals(checkpoint, tmp_path):
    pair = GrpcPair(checkpoint("llama"))
    try:
        out = tmp_path / "report.json"
        result = load_gen.main(
            [
                "--addr",
                pair.decode.address,
                "--num-prompts",
                "24",
                "--request-rate",
                "40",
                "--max-concurrency",
                "8",
                "--random-input-len",
                "24",
                "--random-output-len",
                "8",
                "--output-json",
                str(out),
                "--no-progress",
            ]
        )
        assert result["completed"] == 24 and result["failed"] == 0
        saved = json.loads(out.read_text())
        assert saved["completed"] == 24 and saved["config"]["max_concurrency"] == 8
        assert 0 < saved["median_ttft_ms"] <= saved["median_e2e_latency_ms"] and saved["p99_itl_ms"] > 0
        assert saved["output_throughput"] > 0
        pair.wait_idle()
    finally:
        pair.close()


def test_shared_prefix_workload_reports_what_the_prefix_cache_served(checkpoint):
    """generated-shared-prefix: 3 groups of 4 prompts over a 40-token system prompt, one at a time;
    every prompt after the first of its group finds the system prompt in the prefill cache."""
    jobs = load_gen.shared_prefix_jobs(3, 4, 40, 6, 4, list(range(3, 300)), None, seed=1)
    assert len(jobs) == 12 and all(len(j.prompt_ids) == 46 and j.output_len == 4 for j in jobs)
    assert len({tuple(j.prompt_ids[:40]) for j in jobs}) == 3 and len({tuple(j.prompt_ids) for j in jobs}) == 12
    pair = GrpcPair(checkpoint("llama"))
    try:
        args = ["--addr", pair.decode.address, "--dataset", "generated-shared-prefix", "--max-concurrency", "1"]
        args += ["--gsp-num-groups", "3", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "40"]
        args += ["--gsp-question-len", "6", "--gsp-output-len", "4", "--no-progress"]
        result = load_gen.main(args)
        assert result["completed"] == 12 and result["failed"] == 0
        assert result["cached_token_ratio"] >= (9 * 40) / (12 * 46) - 1e-9, result["cached_token_ratio"]
        pair.wait_idle()
    finally:
        pair.close()


def test_openai_backend_bans_eos_by_bias_and_counts_pieces_without_usage():
    """Against a server that takes no `ignore_eos` and streams no usage (llama.cpp's, in the peers
    benchmark): the request bans the EOS id by logit_bias instead, and the output tokens are the text
    pieces streamed. With no ban it asks for ignore_eos, and a streamed usage wins over the count."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = []

    class Stub(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            events = [{"choices": [{"text": t}]} for t in ("a", "b", "c")]
            if "ignore_eos" in body:
                events.append({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7}})
            for e in events:
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        job = load_gen.Job(prompt_ids=[1, 2, 3], prompt_text="hi", output_len=3)
        banned = load_gen.OpenAIBackend(base, "m", ban_token=2)(job, "r0", 10)
        plain = load_gen.OpenAIBackend(base, "m")(job, "r1", 10)
    finally:
        server.shutdown()
    assert bodies[0]["logit_bias"] == {"2": -100} and "ignore_eos" not in bodies[0]
    assert bodies[1]["ignore_eos"] is True and "logit_bias" not in bodies[1]
    assert banned.ok and banned.output_tokens == 3 and len(banned.itls) == 2
    assert plain.ok and plain.output_tokens == 7 and plain.prompt_tokens == 4
