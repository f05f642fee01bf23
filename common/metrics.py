"""Prometheus metrics of both services, each on its own registry, served on `--metrics-port`.

Every series carries a `model_name` label. Where SGLang has a name for the figure, the series uses
it (`sglang:time_to_first_token_seconds`, `sglang:num_running_reqs`, `sglang:token_usage`, ...,
`SGLANG_NAMES`), so existing dashboards, alerts and autoscalers read it; the rest are ours under
`disagg_`. Decode records what a client sees
(TTFT, ITL, end-to-end, queue time before its slots are reserved, the handoff's transfer time and
bytes, finishes by reason, retries, EAGLE accept length); prefill records its own queue and compute
time, the time and bytes it streams, failures and injected faults. Gauges are read when scraped.
Mixtures of experts add the experts' load (both services, `watch_expert_load`): tokens routed to each
expert summed over the MoE layers, per EP rank with --ep-size > 1, and each layer's imbalance, read
from the device counters (common/models/expert_load.py) once per scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.request_rules import FinishReason

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError:  # a machine without it (a bare GPU node) still runs the services; --metrics-port says why
    CollectorRegistry = Counter = Gauge = Histogram = start_http_server = None

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


SGLANG_NAMES = frozenset(  # served as sglang:<name>
    {
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
        "queue_time_seconds",
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "kv_transfer_speed_gb_s",
        "kv_transfer_latency_ms",
    }
)
TRANSFER_MS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


def series_name(name: str) -> str:
    return f"sglang:{name}" if name in SGLANG_NAMES else f"disagg_{name}"


class _Labelled:
    """A metric with extra labels: `.labels(**kw)` fills in model_name too."""

    def __init__(self, metric, model_name: str):
        self.metric, self.model_name = metric, model_name

    def labels(self, **kw):
        return self.metric.labels(model_name=self.model_name, **kw)


class _Null:
    """Stands in for a metric when prometheus-client is not installed: records nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: self


class _Metrics:
    """A registry with the load gauges both services share (read when scraped)."""

    def __init__(
        self,
        role: str,
        running: Callable[[], float],
        queued: Callable[[], float],
        kv_usage: Callable[[], float],
        model_name: str = "",
    ):
        self.registry = CollectorRegistry() if CollectorRegistry is not None else None
        self.model_name = model_name
        self._http = None
        self._gauge("num_running_reqs", f"requests running ({role})", running)
        self._gauge("num_queue_reqs", f"requests queued ({role})", queued)
        self._gauge("token_usage", f"used share of the {role} KV pool", kv_usage)

    def _new(self, kind, name: str, doc: str, labels=(), **kwargs):
        if self.registry is None:
            return _Null()
        metric = kind(series_name(name), doc, labelnames=("model_name", *labels), registry=self.registry, **kwargs)
        return _Labelled(metric, self.model_name) if labels else metric.labels(model_name=self.model_name)

    def _histogram(self, name: str, doc: str, buckets=LATENCY_BUCKETS):
        return self._new(Histogram, name, doc, buckets=buckets)

    def _counter(self, name: str, doc: str, labels=()):
        return self._new(Counter, name, doc, labels=labels)

    def _gauge(self, name: str, doc: str, read: Callable[[], float]):
        gauge = self._new(Gauge, name, doc)
        gauge.set_function(read)
        return gauge

    def watch_greedy_head(self, runner) -> None:
        """A gauge of the greedy rows its model's greedy head could not settle (each took the fp32
        lm_head as well: common/models/greedy_head.py); 0 while there is no head."""
        self._gauge(
            "greedy_head_fallback_rows",
            "greedy rows the bf16 lm_head pass could not settle (they took the fp32 lm_head too)",
            lambda: getattr(runner.model.greedy_head, "fallback_rows", 0),
        )

    def watch_kv_committed(self, committed: Callable[[], float]) -> None:
        """Decode: the KV slots the running requests have committed (what `token_usage` reserves, less
        the slots held ahead: a growth's worth on demand, the whole max_new_tokens in full)."""
        self._gauge("kv_committed_tokens", "KV slots holding the running requests' committed tokens", committed)

    def watch_expert_load(self, runner) -> None:
        """With an MoE model (`runner.expert_load`, rank 0's device counters): the experts' load
        series, computed from one read of the counters per scrape. Nothing for a dense model."""
        load = getattr(runner, "expert_load", None)
        if load is not None and self.registry is not None:
            self.registry.register(_ExpertLoadCollector(load, self.model_name))

    def _transfer_histograms(self) -> None:
        self.kv_transfer_latency = self._histogram(
            "kv_transfer_latency_ms", "one handoff's KV transfer: first message to record (ms)", TRANSFER_MS_BUCKETS
        )
        self.kv_transfer_speed = self._histogram(
            "kv_transfer_speed_gb_s", "KV GB/s of one handoff: its bytes over its transfer time", GBPS_BUCKETS
        )

    def observe_transfer(self, elapsed: float, nbytes: int) -> None:
        """One handoff's transfer: its time (s), and its speed when KV bytes moved."""
        self.handoff_transfer.observe(elapsed)
        self.kv_transfer_latency.observe(1e3 * elapsed)
        if nbytes and elapsed > 0:
            self.kv_transfer_speed.observe(nbytes / elapsed / 1e9)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics over HTTP on host:port (0 = any free port); the port bound."""
        if self.registry is None:
            raise RuntimeError("--metrics-port needs the prometheus-client package (pip install prometheus-client)")
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _ExpertLoadCollector:
    """The experts' load series, bounded by the experts, layers and EP ranks (not their product):
    `disagg_moe_expert_tokens_total{expert}` (a token counts once per MoE layer for each of its top-k
    experts), `disagg_moe_layer_imbalance{layer}` (a layer's busiest expert's tokens since start over
    the mean; 0 before any token), `disagg_moe_imbalance` (the worst layer's) and, with --ep-size > 1,
    `disagg_moe_ep_rank_tokens_total{rank}` (the tokens routed to the experts each rank holds)."""

    def __init__(self, load, model_name: str):
        self.load, self.model_name = load, model_name

    def collect(self):
        from common.models.expert_load import imbalance

        counts = self.load.read()  # the one device read of this scrape
        per_expert = counts.sum(dim=0).tolist()
        m = [self.model_name]
        tokens = CounterMetricFamily(
            series_name("moe_expert_tokens_total"),
            "tokens routed to each expert, summed over the MoE layers (one per top-k choice)",
            labels=["model_name", "expert"],
        )
        for e, n in enumerate(per_expert):
            tokens.add_metric([*m, str(e)], n)
        yield tokens
        ratios = imbalance(counts)
        layer = GaugeMetricFamily(
            series_name("moe_layer_imbalance"),
            "a MoE layer's busiest expert's tokens over the mean (1 = even; 0 before any token)",
            labels=["model_name", "layer"],
        )
        for i, r in zip(self.load.layers, ratios):
            layer.add_metric([*m, str(i)], r)
        yield layer
        worst = GaugeMetricFamily(
            series_name("moe_imbalance"), "the worst MoE layer's imbalance", labels=["model_name"]
        )
        worst.add_metric(m, max(ratios, default=0.0))
        yield worst
        if self.load.ep_ranks:
            ranks = CounterMetricFamily(
                series_name("moe_ep_rank_tokens_total"),
                "tokens routed to the experts each expert-parallel rank holds, summed over the MoE layers",
                labels=["model_name", "rank"],
            )
            for r, experts in enumerate(self.load.ep_ranks):
                ranks.add_metric([*m, str(r)], sum(per_expert[e] for e in experts))
            yield ranks


class DecodeMetrics(_Metrics):
    def __init__(
        self,
        running: Callable[[], float],
        queued: Callable[[], float],
        kv_usage: Callable[[], float],
        open_streams: Callable[[], float],
        model_name: str = "",
    ):
        super().__init__("decode", running, queued, kv_usage, model_name)
        h, c = self._histogram, self._counter
        self.ttft = h("time_to_first_token_seconds", "Generate call start to its first token")
        self.itl = h(
            "inter_token_latency_seconds", "time between output tokens (a step's tokens share it)", ITL_BUCKETS
        )
        self.e2e = h("e2e_request_latency_seconds", "Generate call start to its last token")
        self.tpot = h(
            "time_per_output_token_seconds",
            "a finished request's first to last token over its later tokens",
            ITL_BUCKETS,
        )
        self.queue_time = h("queue_time_seconds", "submission to the reservation of its request slot and KV")
        self.handoff_transfer = h("handoff_transfer_seconds", "a Prefill call's first message to its record")
        self.spec_accept_length = h(
            "spec_accept_length",
            "EAGLE: tokens per verify step, per request",
            (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0),
        )
        self.requests = c("requests_total", "finished Generate calls by finish reason", ["finish_reason"])
        self.aborts = c("aborted_requests_total", "requests aborted (client cancel, Abort RPC, shutdown)")
        self.failures = c("failed_requests_total", "requests failed (no prefill replica left, scheduler error)")
        self.retries = c("prefill_retries_total", "Prefill calls retried on another replica")
        self.retractions = c("retractions_total", "running requests retracted to free KV (re-prefilled later)")
        self.reprefilled_tokens = c("reprefilled_tokens_total", "output tokens retracted requests resent to prefill")
        self.handoff_bytes = c(
            "handoff_bytes_total", "KV bytes received from prefill (sent, or written into our slots)"
        )
        self.decode_cache_hit_tokens = c(
            "decode_cache_hit_tokens_total", "prompt tokens whose KV decode's prefix cache held (not handed off)"
        )
        self.decode_cache_refetches = c(
            "decode_cache_refetches_total",
            "handoffs from decode's cached prefix a prefill replica refused (asked whole)",
        )
        self.decode_cache_evicted_tokens = c(
            "decode_cache_evicted_tokens_total", "tokens' KV evicted from decode's prefix cache for room"
        )
        self._transfer_histograms()
        self.prompt_tokens = c("prompt_tokens_total", "prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens_total", "tokens generated")
        self.spec_accepted = c("spec_accepted_tokens_total", "EAGLE: draft tokens accepted")
        self.spec_drafted = c("spec_draft_tokens_total", "EAGLE: draft tokens proposed")
        self._gauge("open_streams", "Generate calls open", open_streams)

    def count_finish(self, reason: str, prompt_len: int, started: float, first_at: float, outputs: int) -> None:
        """One finished Generate call: its reason, prompt tokens, and for a completed one its
        end-to-end latency and time per output token (perf_counter times)."""
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_len)
        if reason == FinishReason.ABORT:
            self.aborts.inc()
        elif reason == FinishReason.ERROR:
            self.failures.inc()
        else:
            now = time.perf_counter()
            self.e2e.observe(now - started)
            if outputs > 1:
                self.tpot.observe((now - first_at) / (outputs - 1))


class PrefillMetrics(_Metrics):
    def __init__(
        self,
        running: Callable[[], float],
        queued: Callable[[], float],
        kv_usage: Callable[[], float],
        transfers_in_flight: Callable[[], float] = lambda: 0,
        cache_hit_rate: Callable[[], float] = lambda: 0,
        cache_tokens: Callable[[], float] = lambda: 0,
        model_name: str = "",
    ):
        super().__init__("prefill", running, queued, kv_usage, model_name)
        h, c = self._histogram, self._counter
        self.queue_time = h("prefill_queue_time_seconds", "Prefill call arrival to the start of its batch")
        self.compute = h("prefill_compute_seconds", "prefill compute of the batch the call was in")
        self.handoff_transfer = h("handoff_transfer_seconds", "first token sent to the record sent")
        self.handoff_bytes = c("handoff_bytes_total", "KV bytes sent to decode, by data plane", ["backend"])
        self.kv_transfer_failures = c("kv_transfer_failures_total", "handoffs whose KV transfer failed")
        self._transfer_histograms()
        self.requests = c("prefill_requests_total", "Prefill calls answered with a record")
        self.failures = c("prefill_failures_total", "Prefill calls that failed or were cancelled")
        self.injected = c("injected_faults_total", "handoff faults injected (--inject-faults)", ["kind"])
        self._gauge("kv_transfers_in_flight", "handoffs streaming or writing their KV now", transfers_in_flight)
        self.prompt_tokens = c("prefill_prompt_tokens_total", "prompt tokens of answered Prefill calls")
        self.cached_tokens = c("prefill_cached_tokens_total", "of those, tokens whose KV came from the prefix cache")
        self._gauge("cache_hit_rate", "share of admitted prompt tokens found in the prefix cache", cache_hit_rate)
        self._gauge("prefix_cache_tokens", "KV slots the prefix cache holds", cache_tokens)
