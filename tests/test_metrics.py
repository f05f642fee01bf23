"""Prometheus metrics: after traffic, both services' /metrics show the histograms and counters moving."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.grpc_harness import GrpcPair


def _scrape(port: int, model: str | None = None) -> dict[str, float]:
    """name{labels} -> value; every series must carry model_name (left out of the key)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(("sglang:", "disagg_")) and model is not None:
                assert s.labels.get("model_name") == model, (s.name, s.labels)
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("le", "model_name"))
            if "le" not in s.labels:
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


def test_metrics_move_with_traffic(checkpoint):
    pair = GrpcPair(checkpoint("llama"), prefill_kw=dict(metrics_port=0), decode_kw=dict(metrics_port=0))
    try:
        before = _scrape(pair.decode.metrics_port)
        assert before["sglang:time_to_first_token_seconds_count"] == 0
        for i in range(3):
            pair.collect(pair.generate([5 + i, 6, 7, 8], 6, stream=True, rid=f"m{i}", ignore_eos=True))
        call = pair.generate([9, 10, 11], 200, stream=True, rid="gone", ignore_eos=True)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError):
            list(call)
        pair.wait_idle()
        model = pair.decode.served_model_name  # the checkpoint's folder name, on both services' series
        d, p = _scrape(pair.decode.metrics_port, model), _scrape(pair.prefill.metrics_port, model)
        assert d["sglang:time_to_first_token_seconds_count"] == 4
        assert d["sglang:inter_token_latency_seconds_count"] >= 3 * 5
        assert d["sglang:e2e_request_latency_seconds_count"] == 3
        assert d["sglang:time_per_output_token_seconds_count"] == 3
        assert d["sglang:kv_transfer_latency_ms_count"] >= 3 and p["sglang:kv_transfer_latency_ms_count"] >= 3
        assert d["sglang:queue_time_seconds_count"] == 4 and d["disagg_handoff_transfer_seconds_count"] >= 3
        assert d["disagg_requests_total{finish_reason=length}"] == 3 and d["disagg_aborted_requests_total"] == 1
        assert d["sglang:generation_tokens_total"] >= 19 and d["sglang:prompt_tokens_total"] == 12
        assert d["disagg_handoff_bytes_total"] > 0 and d["disagg_open_streams"] == 0
        assert d["sglang:kv_transfer_speed_gb_s_count"] >= 3 and p["sglang:kv_transfer_speed_gb_s_count"] >= 3
        assert (
            d["sglang:token_usage"] == 0 and d["sglang:num_running_reqs"] == 0 and d["disagg_kv_committed_tokens"] == 0
        )
        assert d["disagg_retractions_total"] == d["disagg_reprefilled_tokens_total"] == 0
        assert d["disagg_greedy_head_fallback_rows"] == p["disagg_greedy_head_fallback_rows"] == 0
        assert p["disagg_prefill_compute_seconds_count"] == 4 and p["disagg_prefill_requests_total"] >= 3
        assert p["disagg_handoff_bytes_total{backend=grpc}"] > 0 and p["disagg_handoff_transfer_seconds_count"] >= 3
        # m0..m2 share [6, 7] after their first token, which is not a prefix: no hits; "again" repeats m0
        assert p["disagg_prefill_prompt_tokens_total"] == 15 and p["disagg_prefill_cached_tokens_total"] == 0
        pair.collect(pair.generate([5, 6, 7, 8], 2, rid="again", ignore_eos=True))
        p = _scrape(pair.prefill.metrics_port)
        assert p["disagg_prefill_cached_tokens_total"] == 3 and p["disagg_prefix_cache_tokens"] >= 4 * 3 + 3
        assert 0 < p["sglang:cache_hit_rate"] < 1
    finally:
        pair.close()


def test_services_run_without_prometheus_client_and_say_why_metrics_cannot():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from common.metrics import DecodeMetrics\n"
        "m = DecodeMetrics(lambda: 0, lambda: 0, lambda: 0, lambda: 0)\n"
        "m.ttft.observe(0.1); m.requests.labels(finish_reason='stop').inc()\n"
        "try:\n    m.serve('127.0.0.1', 0)\nexcept RuntimeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "needs the prometheus-client package" in out.stdout, out.stderr


def test_the_greedy_head_gauge_reads_the_heads_fallbacks():
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from common.metrics import DecodeMetrics

    head = SimpleNamespace(fallback_rows=0)
    runner = SimpleNamespace(model=SimpleNamespace(greedy_head=head))
    m = DecodeMetrics(lambda: 0, lambda: 0, lambda: 0, lambda: 0, model_name="m")
    m.watch_greedy_head(runner)

    def value():
        return m.registry.get_sample_value("disagg_greedy_head_fallback_rows", {"model_name": "m"})

    head.fallback_rows = 5
    assert value() == 5
    runner.model.greedy_head = None  # no head (or dropped at start-up): 0
    assert value() == 0
