"""What a Prefill request may ask of this replica's work, checked before any is done (issue 37).

`parse(request, ...)` turns a PrefillRequest into the scheduler's HandoffRequest after the bounds
below (before any copy). The prompt and sampling rules every request meets (common/request_rules.py,
against one sampled token; `first_output_position` < prompt length) are checked once, where every
caller's request enters the scheduler (PrefillScheduler.submit -> PrefillWorker.validate).

- `max_chunk_bytes`: 0 (the server's flag) or within [MIN_REQUEST_CHUNK_BYTES, MAX_CHUNK_BYTES]
  (common/wire/kv_chunks.py `chunk_bound`); outside it is refused, not clamped: decode never sends
  one, so any other value is a caller to tell, and a tiny one would cost a chunk per token and layer.
- `kv_destination.tp_ranks`: one entry per decode rank, each with the KV heads that rank of a decode
  side of this model holds (common/parallel/tp_shard.py `kv_heads_of`), so their count is a
  tensor-parallel size of the model; the writer copies the KV heads of every entry it is given.
Every violation is a ValueError naming the field (the server answers INVALID_ARGUMENT).
"""

from __future__ import annotations

from common.engine.grammar import check_constraint, runner_compiler
from common.engine.handoff import HandoffRequest, prefix_digest
from common.engine.logprobs import MAX_TOKEN_IDS_LOGPROB
from common.engine.penalties import MAX_LOGIT_BIAS
from common.engine.sampling import SamplingParams
from common.models.config import ModelConfig
from common.parallel.tp_shard import check_divisible, kv_heads_of
from common.request_rules import KvStartRefused, stop_token_ids
from common.wire import kv_chunks
from common.wire.proto_gen import prefill_pb2


def parse(request: prefill_pb2.PrefillRequest, default_chunk_bytes: int, runner) -> HandoffRequest:
    """The request as a HandoffRequest for `runner`'s model and pool; ValueError naming what is wrong."""
    check(request, default_chunk_bytes, runner.config)  # before any copy
    sp = request.sampling_params
    # prefill samples one token: validate against that, whatever the request's decode budget is
    params = SamplingParams(
        max_new_tokens=1,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p or 1.0,
        min_p=sp.min_p,
        seed=sp.seed,
        stop_token_ids=stop_token_ids(sp.stop_token_ids),
        repetition_penalty=sp.repetition_penalty or 1.0,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        logit_bias=logit_bias(sp.logit_bias),
        return_logprob=sp.return_logprob,
        top_logprobs_num=sp.top_logprobs_num,
        token_ids_logprob=token_ids_logprob(sp.token_ids_logprob),
        n=sp.n or 1,  # 0 on the wire: one sample (validated to [1, MAX_N] below)
        logprob_start_len=sp.logprob_start_len if sp.HasField("logprob_start_len") else -1,
        **constraint(sp, runner),
    )
    prompt = list(request.input_ids)  # against the model and pool: the scheduler's check (worker.validate)
    params.min_new_tokens = sp.min_new_tokens  # masks EOS / stop ids if first_output_position is below it
    if request.kv_start and request.kv_start_digest != prefix_digest(prompt[: request.kv_start]):
        raise KvStartRefused("kv_start_digest does not match input_ids[:kv_start]")
    return HandoffRequest(
        request.request_id, prompt, params, sp.seed, request.first_output_position, kv_start=request.kv_start
    )


def constraint(sp, runner) -> dict[str, str]:
    """The oneof constraint as SamplingParams' field, compiled now (on the server's thread, not the
    scheduler's; cached for the first token's mask): GrammarError (a ValueError) names the field."""
    which = sp.WhichOneof("constraint")
    if which is None:
        return {}
    out = {which: getattr(sp, which)}
    check_constraint(SamplingParams(**out))
    runner_compiler(runner).compile((which, out[which]))
    return out


def logit_bias(entries) -> dict[int, float]:
    """The wire's map as {token id: bias}, its size bounded before it is copied (ranges: validate)."""
    if len(entries) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(entries)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    return {int(t): float(b) for t, b in entries.items()}


def token_ids_logprob(ids) -> tuple[int, ...]:
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(f"token_ids_logprob has {len(ids)} ids; at most {MAX_TOKEN_IDS_LOGPROB} are allowed")
    return tuple(ids)


def check(request: prefill_pb2.PrefillRequest, default_chunk_bytes: int, cfg: ModelConfig) -> None:
    kv_chunks.chunk_bound(request.max_chunk_bytes, default_chunk_bytes)
    check_tp_ranks(request.kv_destination, cfg)


def check_tp_ranks(dest: prefill_pb2.KvDestination, cfg: ModelConfig) -> None:
    n = len(dest.tp_ranks)
    if n == 0:
        return
    try:
        check_divisible(cfg, n)
    except ValueError:
        raise ValueError(
            f"kv_destination.tp_ranks names {n} ranks: no tensor-parallel size of this model ({cfg.num_heads} "
            f"attention heads, {cfg.num_kv_heads} KV heads)"
        ) from None
    for r, rank in enumerate(dest.tp_ranks):
        heads = kv_heads_of(cfg, r, n)
        if (rank.kv_head_start, rank.kv_head_count) != (heads.start, len(heads)):
            raise ValueError(
                f"kv_destination.tp_ranks[{r}] holds KV heads [{rank.kv_head_start}, "
                f"{rank.kv_head_start + rank.kv_head_count}); rank {r} of {n} holds [{heads.start}, {heads.stop})"
            )
