"""The Prefill call's request message, built from a HandoffRequest: prompt, sampling parameters and,
with a transfer engine, where prefill writes the KV (decode's pools and this request's slot runs,
signed with the pools' keys so prefill writes nowhere else: common/wire/kv_capability.py)."""

from __future__ import annotations

from common.engine.handoff import HandoffRequest, prefix_digest
from common.kv_transfer.plan import slot_runs
from common.wire import kv_capability
from common.wire.proto_gen import prefill_pb2


def build(
    request: HandoffRequest, max_chunk_bytes: int, kv_destination=None, kv_keys=None, ttl_s: float = 600.0
) -> prefill_pb2.PrefillRequest:
    p = request.params
    msg = prefill_pb2.PrefillRequest(
        request_id=request.rid,
        input_ids=request.prompt_ids,
        max_chunk_bytes=max_chunk_bytes,
        first_output_position=request.first_position,
        kv_start=request.kv_start,
        kv_start_digest=prefix_digest(request.prompt_ids[: request.kv_start]) if request.kv_start else b"",
        sampling_params=prefill_pb2.SamplingParams(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            seed=request.seed,
            max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens,
            stop_token_ids=p.stop_token_ids,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            logit_bias=p.logit_bias,
            return_logprob=p.return_logprob,
            top_logprobs_num=p.top_logprobs_num,
            token_ids_logprob=p.token_ids_logprob,
            n=p.n,
            **({"logprob_start_len": p.logprob_start_len} if p.prompt_logprobs else {}),
            **({p.constraint[0]: p.constraint[1]} if p.constraint is not None else {}),
        ),
    )
    if kv_destination is not None and request.kv_slots is not None:
        msg.kv_destination.CopyFrom(kv_destination)
        positions = len(request.prompt_ids) - request.kv_start  # kv_slots start at position kv_start
        msg.kv_destination.runs.extend(slot_runs(request.kv_slots[:positions].tolist()))
        if kv_keys is not None:  # a capability per rank: valid for this call's lifetime, once
            kv_capability.sign(msg.kv_destination, request.rid, kv_keys, ttl_s)
    return msg
