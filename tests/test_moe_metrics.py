"""The experts' load in metrics (issue 44 part 5): tokens routed to each expert, counted on the device
by the MoE forward (common/models/expert_load.py), equal an independent count of HF's router choices
for the same tokens (prefill: the prompt; decode: each step's input token); read on the host only
when scraped; the series exported by both services, bounded, and absent for a dense model."""

from __future__ import annotations

import itertools
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.metrics import DecodeMetrics, PrefillMetrics
from common.models.expert_load import ExpertLoad, imbalance
from tests.decode_harness import Hooks, Pair
from tests.oracle import hf_model
from tests.test_model_parity import _reserve, _runner

NEW = 6


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Prompts with distinct first tokens: no prefix-cache hit skips a prompt token on prefill."""
    g = torch.Generator().manual_seed(seed)
    firsts = torch.randperm(300, generator=g)[:n] + 3
    return [[int(f)] + torch.randint(3, 384, (k,), generator=g).tolist() for f, k in zip(firsts, [4, 11, 1, 17, 6][:n])]


@torch.inference_mode()
def hf_routed(path: str, tokens: list[int], start: int = 0) -> dict[int, torch.Tensor]:
    """HF's own count (its gate modules hooked): decoder layer -> tokens per expert [E] int64 over
    positions [start, len(tokens)) of one forward of `tokens` (a causal model routes a position the
    same whether it runs in a prefill or as a decode step's input)."""
    model, seen, hooks = hf_model(path), {}, []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            hooks.append(gate.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, out[2])))
    try:
        model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    experts = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.n_routed_experts
    return {i: torch.bincount(ids[start:].reshape(-1), minlength=experts) for i, ids in seen.items()}


def _expected(path: str, prompts: list[list[int]], outputs: list[list[int]], layers) -> tuple:
    """(prefill's counts, decode's counts) [layers, E] that HF's routing gives for these requests."""
    prefill = decode = 0
    for prompt, out in zip(prompts, outputs):
        p, d = hf_routed(path, prompt), hf_routed(path, prompt + out[:-1], start=len(prompt))
        prefill = prefill + torch.stack([p[i] for i in layers])
        decode = decode + torch.stack([d[i] for i in layers])
    return prefill, decode


@pytest.mark.parametrize("variant", ["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("overlap,static", [(False, False), (True, False), (True, True)])
def test_counts_equal_hfs_routing_of_the_tokens_each_side_ran(checkpoint, variant, overlap, static):
    """Prefill ran each prompt, decode each step's input token: the counts equal HF's routing of those
    tokens. With overlap a finished request may have run one step more (launched before its last
    token was seen), whose input is its last output: some set of those extra rows makes it exact.
    With static decode buffers (what a CUDA graph replays) batches of 3, 5, 6 or 7 run padded to a
    bucket of 4 or 8: the padding rows are not counted. There the first forward waits until every
    handoff is in, so a later step runs all 5 requests at once whatever the host's load."""
    path = checkpoint(variant)
    prompts = _prompts(5 if static else 4)
    arrived = []

    def all_in(step: int) -> None:
        deadline = time.monotonic() + 60
        while static and step == 1 and len(arrived) < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.005)

    pair = Pair(path, overlap=overlap, static_decode_buffers=static, hooks=Hooks(before_forward=all_in))
    deliver = pair.link.deliver
    pair.link.deliver = lambda handoff: (deliver(handoff), arrived.append(handoff.rid))
    runner, ran = pair.worker.runner, []
    forward = runner.forward
    runner.forward = lambda fb, *a, **kw: ran.append(fb.input_ids.numel()) or forward(fb, *a, **kw)
    try:
        for i, p in enumerate(prompts):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        pair.wait([str(i) for i in range(len(prompts))])
    finally:
        pair.close()
    prefill, decode = pair.link.worker.runner.expert_load, runner.expert_load
    assert prefill.layers == decode.layers and len(prefill.layers) >= 1
    outputs = [pair.out.tokens[str(i)] for i in range(len(prompts))]
    want_prefill, want_decode = _expected(path, prompts, outputs, prefill.layers)
    k = runner.config.moe.top_k
    assert int(want_prefill[0].sum()) == k * sum(map(len, prompts))  # the count's own sanity
    assert int(want_decode[0].sum()) == k * (NEW - 1) * len(prompts)
    assert torch.equal(prefill.read(), want_prefill), "prefill: tokens per expert differ from HF's routing"
    extra = sum(ran) - (NEW - 1) * len(prompts)
    assert extra == 0 if not overlap else 0 <= extra <= len(prompts)
    lasts = [_expected(path, [p + o[:-1]], [o[-1:] * 2], decode.layers)[1] for p, o in zip(prompts, outputs)]
    sums = [want_decode + sum(s, torch.zeros_like(want_decode)) for s in itertools.combinations(lasts, extra)]
    got = decode.read()
    assert any(torch.equal(got, w) for w in sums), "decode: tokens per expert differ from HF's routing"
    if static:  # some step ran through the static buffers with padding rows
        assert sum(runner.decode_graphs.runs.values()) > 0
        assert any(n not in runner.decode_graphs.buckets for n in ran), ran


class _HostReads(TorchDispatchMode):
    """Every aten op that touches `counts`' storage, and every host read (item) during the mode."""

    def __init__(self, counts: torch.Tensor):
        super().__init__()
        self.ptr, self.ops = counts.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and _storage(t) == self.ptr for t in flat):
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> int | None:
    """The data pointer of t's storage, or None for a tensor without one (a oneDNN-packed weight)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return None


def test_the_forward_only_adds_to_the_counters_in_place(checkpoint):
    """The forward writes the counters with one in-place add per MoE layer and never reads them back
    (no item / tolist / copy of them): the host reads them only on a scrape."""
    runner = _runner(checkpoint("deepseek-v3"))
    load = runner.expert_load
    prompt = _prompts(1)[0]
    row = _reserve(runner, len(prompt))
    with _HostReads(load.counts) as mode:
        runner.forward(ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [prompt]))
    assert sorted(set(mode.ops)) == ["index_add_"] and len(mode.ops) == len(load.layers), mode.ops
    assert int(load.read().sum()) == len(load.layers) * runner.config.moe.top_k * len(prompt)


def _series(registry, name: str) -> dict[str, float]:
    return {
        ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_series_are_bounded_read_once_per_scrape_and_sum_the_ep_ranks(checkpoint, monkeypatch):
    runner = _runner(checkpoint("qwen3-moe"))
    model, spec = runner.model, runner.config.moe
    assert ExpertLoad.attach(model, SimpleNamespace(rank=1, size=2), 2) is None  # rank 0 alone counts
    load = ExpertLoad.attach(model, SimpleNamespace(rank=0, size=2), 2)  # the counters rank 0 of EP 2 has
    reads = []
    monkeypatch.setattr(load, "read", lambda: reads.append(1) or load.counts.clone())
    prompt = _prompts(2)[1]
    row = _reserve(runner, len(prompt))
    runner.forward(ForwardBatch.extend(runner.req_to_token_pool.req_to_token, [row], [0], [prompt]))
    assert not reads  # forwards never read the counters
    m = PrefillMetrics(lambda: 0, lambda: 0, lambda: 0, model_name="m")
    m.watch_expert_load(SimpleNamespace(expert_load=load))
    counts = load.counts.clone()
    per_expert = _series(m.registry, "disagg_moe_expert_tokens_total")
    assert len(reads) == 1  # one read for the whole scrape
    assert per_expert == {f"expert={e}": float(n) for e, n in enumerate(counts.sum(0).tolist())}
    assert sum(per_expert.values()) == len(load.layers) * spec.top_k * len(prompt)
    ranks = _series(m.registry, "disagg_moe_ep_rank_tokens_total")
    half = spec.num_experts // 2
    assert ranks == {"rank=0": float(counts[:, :half].sum()), "rank=1": float(counts[:, half:].sum())}
    layers = _series(m.registry, "disagg_moe_layer_imbalance")
    ratios = {f"layer={i}": r for i, r in zip(load.layers, imbalance(counts))}
    assert layers == pytest.approx(ratios) and all(r >= 1 for r in ratios.values())
    worst = _series(m.registry, "disagg_moe_imbalance")[""]
    assert worst == pytest.approx(max(ratios.values()))
    one = counts[0].double()
    assert ratios[f"layer={load.layers[0]}"] == pytest.approx(float(one.max() / one.mean()))


def test_imbalance_is_even_at_one_worst_at_experts_over_k_and_zero_before_tokens():
    counts = torch.tensor([[3, 3, 3, 3], [6, 6, 0, 0], [0, 0, 0, 0]])
    assert imbalance(counts) == [1.0, 2.0, 0.0]


def test_a_dense_model_exports_no_expert_series(checkpoint):
    runner = _runner(checkpoint("llama"))
    assert runner.expert_load is None
    m = DecodeMetrics(lambda: 0, lambda: 0, lambda: 0, lambda: 0, model_name="m")
    m.watch_expert_load(runner)
    names = {s.name for family in m.registry.collect() for s in family.samples}
    assert names and not any(n.startswith("disagg_moe_") for n in names)


def _scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name") + "}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("disagg_moe_")
    }


def test_both_services_export_the_counts_after_warm_up(checkpoint):
    """Over gRPC: each service's scrape shows the tokens its own forwards routed (warm-up's wiped;
    overlap off: no extra step after a request's last token)."""
    from tests.grpc_harness import GrpcPair

    path = checkpoint("qwen3-moe")
    prompts = _prompts(2, seed=8)
    pair = GrpcPair(path, overlap=False, prefill_kw=dict(metrics_port=0), decode_kw=dict(metrics_port=0))
    try:
        outputs = [pair.collect(pair.generate(p, NEW, rid=f"s{i}", ignore_eos=True))[0] for i, p in enumerate(prompts)]
        pair.wait_idle()
        d, p = _scrape(pair.decode.metrics_port), _scrape(pair.prefill.metrics_port)
    finally:
        pair.close()
    layers = tuple(hf_routed(path, prompts[0]))
    want_prefill, want_decode = _expected(path, prompts, outputs, layers)
    for scraped, want in ((p, want_prefill), (d, want_decode)):
        got = [scraped[f"disagg_moe_expert_tokens_total{{expert={e}}}"] for e in range(want.shape[1])]
        assert got == want.sum(0).tolist(), "decode" if scraped is d else "prefill"
        assert scraped["disagg_moe_imbalance{}"] == pytest.approx(max(imbalance(want)))
        assert not any("ep_rank" in name for name in scraped)  # no expert parallelism here
