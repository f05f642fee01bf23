"""The greedy head (common/models/greedy_head.py): its bound holds, its tokens are the fp32 argmax
(ties to the lowest id, the fallback where the bound cannot settle a row), its use is chosen by
measurement (made-up timings here) or forced, and a decode with it on matches HF token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine.sampling import SamplingParams
from common.models import greedy_head, host_table, linear_tuning, packed_linear
from common.models.greedy_head import GreedyHead
from common.models.packed_linear import ROW_BUCKETS, LinearWeight
from tests.decode_harness import Hooks, Pair
from tests.oracle import hf_greedy
from tests.test_eagle import PROMPTS, _planted, _run, _spec, heads  # noqa: F401 (fixture)
from tests.test_eagle_tree import _tree_spec

pytestmark = pytest.mark.skipif(
    not (greedy_head.available() and packed_linear.available(torch.device("cpu"), torch.float32)),
    reason="needs oneDNN bf16 GEMMs on this CPU",
)


def _head(vocab=3000, hidden=64, seed=0, scale=0.2, candidates=greedy_head.CANDIDATES) -> GreedyHead:
    g = torch.Generator().manual_seed(seed)
    return GreedyHead(LinearWeight(torch.randn(vocab, hidden, generator=g) * scale), candidates)


def _hidden(rows, hidden=64, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.rms_norm(torch.randn(rows, hidden, generator=g), (hidden,)) * 3


def test_the_bound_covers_every_approximate_logit():
    """D (the bound the safety test uses) is never exceeded by |bf16-pass logit - exact logit|."""
    head, h = _head(), _hidden(64)
    low = h.to(torch.bfloat16)
    approx = torch.ops.mkldnn._linear_pointwise(low, head.packed, None, "none", [], "").float()
    exact = (h.double() @ head.lm_head.weight.double().t()).float()
    bound = head.bound(h, low)
    err = (approx - exact).abs() - 2.0**-8 / (1 - 2.0**-8) * approx.abs()  # less the output's own rounding
    assert (err <= bound[:, None]).all()
    assert (err.max(dim=1).values > 0.05 * bound).all(), "the bound is not vacuous: errors reach a share of it"


def test_the_bound_is_nearly_reached_by_a_row_along_the_weight_error():
    """h exact in bf16 and along the rounding error of the row whose error is largest: the whole
    error is the weight term, and it comes within a few percent of D."""
    head = _head()
    w = head.lm_head.weight
    err_rows = (w.double() - w.to(torch.bfloat16).double()).norm(dim=1)
    i = int(err_rows.argmax())
    low = ((w[i] - w[i].to(torch.bfloat16).float()) * 1e4).to(torch.bfloat16)[None]
    h = low.float()
    approx = torch.ops.mkldnn._linear_pointwise(low, head.packed, None, "none", [], "").float()[0, i]
    exact = float(w[i].double() @ h[0].double())
    err = abs(float(approx) - exact) - 2.0**-8 / (1 - 2.0**-8) * abs(float(approx))
    bound = float(head.bound(h, low))
    assert 0.9 * bound < err <= bound


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_tokens_are_the_fp32_argmax(rows):
    head, h = _head(), _hidden(rows)
    assert torch.equal(head.tokens(h), F.linear(h, head.lm_head.weight).argmax(dim=-1))
    assert head.fallback_rows == 0, "random rows are settled by the bound"


def test_ties_go_to_the_lowest_id_as_argmax_does():
    head = _head(vocab=500)
    w = head.lm_head.weight
    h = _hidden(4)
    best = F.linear(h, w).argmax(dim=-1)
    for row, b in enumerate(best.tolist()):  # a copy of each row's winner at a lower id: an exact tie
        w[row * 7] = w[b]
    head = GreedyHead(LinearWeight(w))
    ref = F.linear(h, w).argmax(dim=-1)
    assert ref.tolist() == [row * 7 for row in range(4)]
    assert torch.equal(head.tokens(h), ref)


@pytest.mark.parametrize("seed", range(4))
def test_rows_within_bf16_noise_are_settled_in_fp32(seed):
    """Twenty rows closer than bf16 can tell apart, and two candidates: the bf16 ranking of the twenty
    is noise, so only the bound (which fails these rows) keeps the token the fp32 argmax."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 64, generator=g) * 0.2
    w[200:220] = w[7] + 1e-5 * torch.randn(20, 64, generator=g)
    head = GreedyHead(LinearWeight(w), candidates=2)
    h = w[7:8] * 40 + 0.01 * torch.randn(4, 64, generator=g)
    ref = F.linear(h, w).argmax(dim=-1)
    assert torch.equal(head.tokens(h), ref)
    assert head.fallback_rows == 4


def test_rows_the_bound_cannot_settle_take_the_fp32_lm_head():
    """More near-equal logits than candidates: the bound fails and the row is computed in fp32;
    a non-finite row too."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(400, 64, generator=g) * 0.2
    w[100:140] = w[3] + 1e-4 * torch.randn(40, 64, generator=g)  # 41 rows within bf16 noise of each other
    head = GreedyHead(LinearWeight(w), candidates=8)
    h = _hidden(3)
    h[0] = w[3] * 50  # row 0's winner is among the 41: the bound cannot separate 8 of them from the rest
    h[2, 5] = float("nan")
    ids, safe = head.candidates(h)
    assert safe.tolist() == [False, True, False]
    ref = F.linear(h, w).argmax(dim=-1)
    assert torch.equal(head.tokens(h), ref) and head.fallback_rows == 2


def test_the_plan_is_measured_or_forced(monkeypatch):
    head = _head()
    calls = []

    def fake(h, rows):  # the greedy head wins from 8 rows on
        calls.append(rows)
        return {"fp32": 2.0, "bf16": 1.0 if rows >= 8 else 3.0}

    ms = linear_tuning.tune_greedy(head, measure=fake)
    assert calls == list(ROW_BUCKETS)
    table = linear_tuning.LayoutTable("mkl", 1, greedy_ms=ms)
    assert table.greedy_plan == tuple(r >= 8 for r in ROW_BUCKETS)
    assert any("greedy" in line for line in table.lines())

    monkeypatch.setattr(linear_tuning, "tune_greedy", lambda h: ms)
    weights = [LinearWeight(torch.randn(16, 8))]
    linear_tuning.tune_and_log(weights, "mkl", head, "auto")
    assert head.plan == table.greedy_plan and not head.used_for(1) and head.used_for(8) and head.used_for(500)
    linear_tuning.tune_and_log(weights, "mkl", head, "on")
    assert all(head.plan)
    linear_tuning.tune_and_log(weights, "mkl", head, "off")
    assert not any(head.plan)
    with pytest.raises(ValueError, match="greedy-head"):
        linear_tuning.tune_and_log(weights, "mkl", head, "fastest")
    seconds = linear_tuning.measure_greedy(head, 2)  # the real timer: both ways, in seconds
    assert set(seconds) == {"fp32", "bf16"} and all(0 < s < 1 for s in seconds.values())


def test_the_host_table_keeps_the_greedy_timing(tmp_path, monkeypatch):
    """The greedy timing is stored with the layouts and loaded with them; a table stored without it
    (no greedy head then) is timed again once a model has one."""
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(
        linear_tuning, "measure", lambda ws, rows: {"mkl": 1.0, "onednn": 2.0, "rowblock": 3.0, "panels": 4.0}
    )
    timed = []

    def fake(h, rows):
        timed.append(rows)
        return {"fp32": 2.0, "bf16": 1.0}

    monkeypatch.setattr(linear_tuning, "measure_greedy", fake)
    monkeypatch.setattr(linear_tuning.tune_greedy, "__defaults__", (fake,))

    def start(with_head: bool) -> GreedyHead | None:
        lm_head = LinearWeight(torch.randn(3000, 64))
        head = GreedyHead(lm_head) if with_head else None
        table = linear_tuning.tune_and_log([lm_head], "auto", head, "auto")
        return head, table

    _, table = start(False)
    assert not table.greedy_ms and not timed
    head, table = start(True)
    assert len(timed) == len(ROW_BUCKETS) and all(head.plan), "timed again: the stored table had no greedy timing"
    head, table = start(True)
    assert len(timed) == len(ROW_BUCKETS) and table.source and all(head.plan), "loaded, not timed"


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied", "qwen3"])
def test_decode_with_the_greedy_head_matches_hf(checkpoint, arch):
    path = checkpoint(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 384, (n,), generator=g).tolist() for n in (3, 17, 9, 30)]
    pair = Pair(path, greedy_head="on")
    head, first = pair.worker.runner.model.greedy_head, pair.link.worker.runner.model.greedy_head
    decode_rows, prefill_rows = [], []  # the prefill's first tokens come through its own runner's head
    for h, rows in ((head, decode_rows), (first, prefill_rows)):
        h.tokens = lambda x, rows=rows, real=h.tokens: rows.append(x.shape[0]) or real(x)
    fused, in_call = pair.worker.runner.model.fused_layers, []  # rows whose tokens its candidates found in the call
    if fused is not None:
        takes = fused.takes_head

        def counted(rows, greedy, h=None):
            ok = takes(rows, greedy, h)
            if ok and fused._greedy is not None:
                in_call.append(rows)
            return ok

        fused.takes_head = counted
    try:
        for i, p in enumerate(prompts):
            pair.submit(str(i), p, SamplingParams(max_new_tokens=16, ignore_eos=True))
        pair.wait([str(i) for i in range(len(prompts))])
    finally:
        pair.close()
    for i, p in enumerate(prompts):
        assert pair.out.tokens[str(i)] == hf_greedy(path, p, 16), f"prompt {i}"
    assert head is not None and head.fallback_rows < 4 * 15 // 2, "the bf16 pass decided most tokens"
    assert prefill_rows, "the first tokens came from the prefill runner's greedy head"
    assert sum(decode_rows) + sum(in_call) >= 4 * 15, "every decode step's tokens came from the head"


def test_eagle_chain_and_tree_verify_through_the_greedy_head_match_hf(checkpoint, heads):
    """EAGLE's verify takes the target's argmax from the greedy head too (and an EAGLE head without a
    token map its drafts, through the target's lm_head): planted chain drafts (so runs of several
    tokens are accepted) and a random tree head, each token for token with HF."""
    path = checkpoint("llama")
    propose, _ = _planted(path)
    setups = (  # (a pair, verify rows per request: S + 1, or the tree's nodes), each built when its turn comes
        (
            lambda: Pair(
                path, spec=_spec(heads(path, "EAGLE"), "EAGLE"), hooks=Hooks(propose=propose), greedy_head="on"
            ),
            4,
        ),
        (lambda: Pair(path, spec=_tree_spec(heads(path, "EAGLE3"), "EAGLE3", 2, 3, 6), greedy_head="on"), 6),
    )
    for make, per_request in setups:
        pair = make()
        head, rows = pair.worker.runner.model.greedy_head, []
        real = head.tokens
        head.tokens = lambda h, rows=rows, real=real: rows.append(h.shape[0]) or real(h)
        try:
            out = _run(pair, PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True))
        finally:
            pair.close()
        for i, p in enumerate(PROMPTS):
            assert out[str(i)] == hf_greedy(path, p, 20), f"prompt {i}"
        verifies = [r for r in rows if r > len(PROMPTS)]  # (a head without a token map drafts B rows)
        assert verifies and all(r % per_request == 0 for r in verifies), "verifies went through the head"
        if per_request == 4:
            accepted, proposed = pair.scheduler.spec_stats
            assert accepted >= 0.8 * proposed, "the planted chains were accepted"


def test_the_model_routes_each_row_count_by_the_plan(checkpoint):
    """greedy_tokens takes the head only for the row buckets its plan names, and equals argmax of
    the fp32 logits either way; `--greedy-head off` builds no head (no bf16 copy held)."""
    from common.engine.model_runner import ModelRunner, RunnerArgs

    path = checkpoint("qwen3")
    model = ModelRunner(RunnerArgs(path, max_total_tokens=64, greedy_head="on")).model
    head, calls = model.greedy_head, []
    real = head.tokens
    head.tokens = lambda h: calls.append(h.shape[0]) or real(h)
    head.set_plan((True, False) + (True,) * (len(ROW_BUCKETS) - 2))
    h = _hidden(3, hidden=model.config.hidden_size)
    for rows in (1, 2, 3):
        assert torch.equal(model.greedy_tokens(h[:rows]), model.compute_logits(h[:rows]).argmax(dim=-1))
    assert calls == [1, 3], "2 rows are in the bucket the plan leaves to the fp32 lm_head"
    assert ModelRunner(RunnerArgs(path, max_total_tokens=64, greedy_head="off")).model.greedy_head is None
    with pytest.raises(ValueError, match="greedy-head"):
        ModelRunner(RunnerArgs(path, max_total_tokens=64, greedy_head="fast"))


def test_an_eagle_head_without_a_token_map_drafts_through_the_greedy_head(checkpoint, heads):
    from common.engine.model_runner import ModelRunner, RunnerArgs

    path = checkpoint("llama")
    runner = ModelRunner(
        RunnerArgs(path, max_total_tokens=64, spec=_spec(heads(path, "EAGLE"), "EAGLE"), greedy_head="on")
    )
    head, calls = runner.model.greedy_head, []
    real = head.tokens
    head.tokens = lambda h: calls.append(h.shape[0]) or real(h)
    h = _hidden(5, hidden=runner.config.hidden_size)
    assert torch.equal(runner.draft.greedy(h), runner.draft.logits(h).argmax(dim=-1))
    assert calls == [5]


def test_a_head_over_the_whole_vocabulary_and_a_non_finite_lm_head():
    """K as large as the vocabulary: nothing lies outside the candidates, so no fallback for finite
    rows; an lm_head with a NaN gets no head at all (no bound holds for it)."""
    head, h = _head(vocab=20, candidates=64), _hidden(3)
    assert head.k == 20 and torch.equal(head.tokens(h), F.linear(h, head.lm_head.weight).argmax(dim=-1))
    assert head.fallback_rows == 0
    w = torch.randn(5000, 64)
    w[4500, 3] = float("nan")
    assert GreedyHead.build(LinearWeight(w)) is None
    with pytest.raises(ValueError, match="non-finite"):
        GreedyHead(LinearWeight(w))


def test_a_malformed_greedy_timing_in_the_host_table_is_timed_again(tmp_path, monkeypatch):
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    shapes, ms = [(3000, 64, False)], {name: [1.0] * len(ROW_BUCKETS) for name in packed_linear.LAYOUTS}
    plans = {shapes[0]: ("mkl",) * len(ROW_BUCKETS)}
    good = {"fp32": [2.0] * len(ROW_BUCKETS), "bf16": [1.0] * len(ROW_BUCKETS)}
    for bad in (["bf16", "fp32"], {"fp32": [None] * len(ROW_BUCKETS), "bf16": good["bf16"]}, {"fp32": [1.0]}):
        host_table.write(shapes, 1, plans, ms, [1.0] * len(ROW_BUCKETS), bad)
        assert host_table.read(shapes, 1) is None, bad
    host_table.write(shapes, 1, plans, ms, [1.0] * len(ROW_BUCKETS), good)
    assert host_table.read(shapes, 1)["greedy_ms"] == good
