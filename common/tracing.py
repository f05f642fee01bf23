"""OpenTelemetry tracing, off unless `--otlp-traces-endpoint` is given: one trace per request.

Decode's front door opens a `generate` span (a child of the caller's, when smg or a client sends
`traceparent`); the prefill client adds `queue` (submission to the call) and one `prefill_call`
span per attempt, whose context rides to the prefill replica as `traceparent` gRPC metadata; the
replica adds `prefill` with `queue`, `compute` and `transfer` children; decode ends with `decode`
(first token to finish). Spans are recorded from timestamps after the fact (explicit start and end
times), so no span object is shared between threads beyond its context.

`--otlp-traces-endpoint host:4317` exports over OTLP/gRPC; `memory://` keeps spans in this process
(`memory_spans()`, for tests).
"""

from __future__ import annotations

import time

MEMORY = "memory://"
_memory = None  # the in-process exporter behind memory:// (shared by the services of one process)
_CLOCK_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def wall_ns(perf_s: float) -> int:
    """A time.perf_counter() reading as wall-clock nanoseconds (what spans carry)."""
    return int(perf_s * 1e9) + _CLOCK_OFFSET_NS


def memory_spans() -> list:
    return list(_memory.get_finished_spans()) if _memory is not None else []


class Tracing:
    def __init__(self, service: str, endpoint: str | None):
        self.tracer = None
        if not endpoint:
            return
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError as e:
            raise ValueError("--otlp-traces-endpoint needs opentelemetry-sdk (pip install opentelemetry-sdk)") from e
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if endpoint == MEMORY:
            global _memory
            if _memory is None:
                from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

                _memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(_memory))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        self.provider = provider
        self.tracer = provider.get_tracer("disagg-serve")

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def start(self, name: str, parent=None, start_ns: int | None = None, **attributes):
        """An open span (end it with `.end()`), or None when tracing is off."""
        if self.tracer is None:
            return None
        return self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes or None)

    def record(self, name: str, parent, start_ns: int, end_ns: int, **attributes) -> None:
        """A finished span from two timestamps."""
        span = self.start(name, parent, start_ns, **attributes)
        if span is not None:
            span.end(end_time=max(end_ns, start_ns))

    @staticmethod
    def context_of(span):
        """The context whose children hang under `span` (None for no span)."""
        if span is None:
            return None
        from opentelemetry import trace

        return trace.set_span_in_context(span)

    @staticmethod
    def inject(context) -> tuple:
        """gRPC metadata carrying `context` (traceparent), or ()."""
        if context is None:
            return ()
        from opentelemetry import propagate

        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=context)
        return tuple(carrier.items())

    def extract(self, metadata) -> object:
        """The caller's context from gRPC metadata (None when tracing is off or nothing came)."""
        if self.tracer is None:
            return None
        from opentelemetry import propagate

        carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        return propagate.extract(carrier) if "traceparent" in carrier else None

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.provider.shutdown()
