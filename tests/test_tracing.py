"""OpenTelemetry: one trace per request from the front door through the prefill hop (traceparent
carried as gRPC metadata), collected in memory (`--otlp-traces-endpoint memory://`)."""

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common import tracing
from tests.grpc_harness import GrpcPair

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is a dependency (.ci/setup installs it)")


def test_one_trace_holds_decode_and_prefill_spans(checkpoint):
    flags = dict(otlp_traces_endpoint=tracing.MEMORY)
    pair = GrpcPair(checkpoint("llama"), prefill_kw=flags, decode_kw=flags)
    try:
        caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a gateway's traceparent
        request = pb.GenerateRequest(
            request_id="t",
            tokenized=pb.TokenizedInput(input_ids=[5, 6, 7, 8]),
            sampling_params=pb.SamplingParams(max_new_tokens=4, ignore_eos=True),
            stream=True,
        )
        call = pair.stub.Generate(request, metadata=(("traceparent", caller),))
        assert sum(len(r.chunk.token_ids) for r in call if r.HasField("chunk")) == 4
        pair.wait_idle()
    finally:
        pair.close()
    spans = [s for s in tracing.memory_spans() if s.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C]
    by_name = {s.name: s for s in spans}
    assert {"generate", "queue", "prefill_call", "prefill", "compute", "transfer", "decode"} <= set(by_name), sorted(
        by_name
    )
    gen, call_span, prefill = by_name["generate"], by_name["prefill_call"], by_name["prefill"]
    assert gen.parent.span_id == 0xB7AD6B7169203331  # under the caller's span
    assert call_span.parent.span_id == gen.context.span_id  # decode side
    assert prefill.parent.span_id == call_span.context.span_id  # the hop: prefill's span under decode's call
    assert (
        prefill.resource.attributes["service.name"] == "prefill" and gen.resource.attributes["service.name"] == "decode"
    )
    assert by_name["compute"].parent.span_id == prefill.context.span_id
    assert gen.start_time <= by_name["decode"].start_time <= by_name["decode"].end_time <= gen.end_time


def test_tracing_is_off_by_default(checkpoint):
    pair = GrpcPair(checkpoint("llama"))
    try:
        assert not pair.decode.tracing.enabled and not pair.prefill.tracing.enabled
        assert pair.collect(pair.generate([5, 6], 2, rid="off", ignore_eos=True))[0]
    finally:
        pair.close()
