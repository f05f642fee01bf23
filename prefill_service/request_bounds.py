"""What a Prefill request may ask of this replica's work, checked before any is done (issue 37).

- `max_chunk_bytes`: 0 (the server's flag) or within [MIN_REQUEST_CHUNK_BYTES, MAX_CHUNK_BYTES]
  (common/wire/kv_chunks.py `chunk_bound`); outside it is refused, not clamped: decode never sends
  one, so any other value is a caller to tell, and a tiny one would cost a chunk per token and layer.
- `kv_destination.tp_ranks`: one entry per decode rank, each with the KV heads that rank of a decode
  side of this model holds (common/parallel/tp_shard.py `kv_heads_of`), so their count is a
  tensor-parallel size of the model; the writer copies the KV heads of every entry it is given.
Every violation is a ValueError naming the field (the server answers INVALID_ARGUMENT).
"""

from __future__ import annotations

from common.models.config import ModelConfig
from common.parallel.tp_shard import check_divisible, kv_heads_of
from common.wire import kv_chunks
from common.wire.proto_gen import prefill_pb2


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
