"""Choosing a prefill replica by its prefix cache (decode_service/prefix_router.py): the rule alone
(model-free), then two replicas behind one decode, cache-aware against least-loaded."""

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from decode_service.config import DecodeConfig
from decode_service.prefix_router import CACHE_THRESHOLD, PrefixRouter
from decode_service.server import DecodeService
from prefill_service.config import PrefillConfig
from prefill_service.server import PrefillService
from tests.oracle import hf_greedy
from tests.test_prefill_replicas import _generate, _tokens, _wait_idle

SYS_A, SYS_B = list(range(10, 50)), list(range(60, 100))


def test_a_shared_prefix_follows_the_replica_that_has_it():
    router = PrefixRouter()
    first = router.choose({"a": 0, "b": 0}, SYS_A + [1])
    other = router.choose({"a": 0, "b": 0}, SYS_B + [1])
    assert other != first  # nothing cached: the least loaded, then the smaller tree
    for i in range(3):
        assert router.choose({"a": 1, "b": 0}, SYS_A + [2 + i]) == first  # a small spread: the cache decides
        assert router.choose({"a": 0, "b": 1}, SYS_B + [2 + i]) == other
    assert router.hit_rate > 0.7


def test_far_apart_loads_override_the_cache_and_short_matches_do_not_count():
    router = PrefixRouter()
    home = router.choose({"a": 0, "b": 0}, SYS_A)
    away = "b" if home == "a" else "a"
    assert router.choose({home: 20, away: 2}, SYS_A + [1]) == away  # imbalanced: balance first
    short = SYS_A[: int(CACHE_THRESHOLD * 40) - 1] + list(range(200, 222))  # under the threshold
    assert router.choose({home: 1, away: 0}, short) == away


def test_least_loaded_policy_ignores_the_cache_and_trees_stay_bounded():
    router = PrefixRouter("least_loaded")
    router.choose({"a": 0, "b": 0}, SYS_A)
    assert router.choose({"a": 1, "b": 0}, SYS_A + [1]) == "b"
    router = PrefixRouter()
    router.set_capacity("a", 50)
    for i in range(5):
        router.choose({"a": 0}, [i] * 20)
    assert router.trees["a"].tree_size <= 50
    with pytest.raises(ValueError, match="policy"):
        PrefixRouter("random")


@pytest.mark.parametrize("policy", ["cache_aware", "least_loaded"])
def test_two_replicas_serve_shared_prefixes_from_their_caches(checkpoint, policy):
    """Two system prompts, four requests each, one at a time (a a b b a a b b): cache-aware sends each
    group to one replica (3 hits per group); least-loaded takes tied replicas in turn and spreads
    them. Tokens are HF-exact either way."""
    path = checkpoint("qwen2")
    replicas = [PrefillService(PrefillConfig(path, port=0)).start() for _ in range(2)]
    addrs = ",".join(r.address for r in replicas)
    decode = DecodeService(DecodeConfig(path, prefill_addr=addrs, port=0, prefill_policy=policy)).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        order = [(name, system, i) for r in (0, 2) for name, system in (("a", SYS_A), ("b", SYS_B)) for i in (r, r + 1)]
        for name, system, i in order:
            prompt = system + [3 + i]
            ids, reason = _tokens(_generate(stub, prompt, 4, f"{name}{i}"))
            assert ids == hf_greedy(path, prompt, 4) and reason == "length"
        hits = sum(r.worker.stats.hits for r in replicas)
        if policy == "cache_aware":
            assert hits == 6 and decode.prefill.router.hit_rate > 0.6
        else:
            assert hits < 6
        _wait_idle(decode)
    finally:
        decode.stop()
        for r in replicas:
            r.stop()
