"""The CPU fp32 linear layouts (common/models/packed_linear.py) against F.linear, and the start-up
choice among them (common/models/linear_tuning.py) with made-up timings, so it is deterministic."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.host_load import Conditions
from common.models import cpu_fused, host_table, linear_tuning, packed_linear
from common.models.linear_tuning import measure, tune
from common.models.packed_linear import LAYOUTS, ROW_BUCKETS, LinearWeight, bucket_index, linear_weights

pytestmark = pytest.mark.skipif(
    not packed_linear.available(torch.device("cpu"), torch.float32), reason="needs oneDNN on CPU"
)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("out_features", [96, 100, 37])  # 8, 4 and 1 row blocks
@pytest.mark.parametrize("bias", [False, True])
def test_every_layout_equals_f_linear(layout, out_features, bias):
    gen = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, 48, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    lin = LinearWeight(w, b)
    if layout == "panels":  # the fused ops' GEMM (without them the layout is F.linear itself)
        lin.set_panels(cpu_fused.load())
        assert lin.panels is not None
    lin.set_plan((layout,) * len(ROW_BUCKETS))
    for rows in (1, 2, 3, 17, 200):
        for shape in ((rows, 48), (1, rows, 48)):
            x = torch.randn(shape, generator=gen)
            residual = torch.randn(shape[:-1] + (out_features,), generator=gen)
            want = F.linear(x, w, b)
            got = lin(x)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lin(x, residual), residual + want, atol=1e-5, rtol=1e-5)


def test_blocks_view_the_weight_and_stay_put():
    """The row-block layout is a view of the plain weight (no copy); the weight is detached."""
    w = torch.randn(64, 16, requires_grad=True)
    lin = LinearWeight(w)
    assert lin.blocks.shape == (8, 8, 16) and lin.blocks.data_ptr() == w.data_ptr()
    assert not lin(torch.randn(1, 16)).requires_grad


def test_rows_map_to_the_first_bucket_that_holds_them():
    assert [bucket_index(r) for r in (1, 2, 3, 4, 5, 33, 64, 65, 256, 512)] == [0, 1, 2, 2, 3, 6, 6, 7, 7, 7]
    assert bucket_index(4096) == len(ROW_BUCKETS) - 1  # prefill chunks: the largest bucket's plan
    assert all(ROW_BUCKETS[bucket_index(r)] >= r for r in range(1, ROW_BUCKETS[-1] + 1))


def test_a_plan_dispatches_each_row_count_to_its_layout(monkeypatch):
    lin = LinearWeight(torch.randn(16, 8))
    plan = ("rowblock", "mkl") + ("onednn",) * (len(ROW_BUCKETS) - 2)
    lin.set_plan(plan)
    seen = []
    run = lin.run
    monkeypatch.setattr(lin, "run", lambda layout, x2, residual=None: seen.append(layout) or run(layout, x2, residual))
    for rows in (1, 2, 3, 300):
        lin(torch.randn(rows, 8))
    assert seen == ["rowblock", "mkl", "onednn", "onednn"]
    with pytest.raises(ValueError, match="one of"):
        lin.set_plan(("gpu",) * len(ROW_BUCKETS))
    with pytest.raises(ValueError, match="per row bucket"):
        lin.set_plan(("mkl",))


def _model():
    """Two weights of one shape, one of another, and a bias: three groups."""
    return nn.Sequential(nn.Linear(8, 32, bias=False), nn.Linear(32, 8), nn.Linear(8, 32, bias=False))


def test_tuning_keeps_the_fastest_layout_per_shape_and_bucket():
    model = packed_linear.pack_linears(_model())
    weights = linear_weights(model, model[0].weight)  # listed twice: counted once
    assert len(weights) == 3

    def fake_measure(weights, rows):  # wide weights: rowblock wins one row, panels the most, oneDNN between
        assert len({w.shape_key for w in weights}) == 1
        if weights[0].out_features == 32:
            return {
                "mkl": 3.0,
                "onednn": 2.0,
                "rowblock": 1.0 if rows == 1 else 5.0,
                "panels": 1.5 if rows > 64 else 4.0,
            }
        return {"mkl": 1.0, "onednn": 2.0, "rowblock": 3.0, "panels": 4.0}

    table = tune(weights, "auto", measure=fake_measure)
    wide = ("rowblock",) + ("onednn",) * (len(ROW_BUCKETS) - 2) + ("panels",)
    assert model[0].weight.plan == model[2].weight.plan == wide
    assert model[1].weight.plan == ("mkl",) * len(ROW_BUCKETS) and model[1].weight.packed is None
    assert model[0].weight.packed is not None
    # whole-model ms per bucket: two wide weights and one narrow one
    assert table.ms["mkl"][0] == 1e3 * (2 * 3.0 + 1.0) and table.chosen_ms[0] == 1e3 * (2 * 1.0 + 1.0)
    assert table.chosen_ms[1] == 1e3 * (2 * 2.0 + 1.0) and table.chosen_ms[-1] == 1e3 * (2 * 1.5 + 1.0)
    lines = table.lines()
    assert "threads" in lines[0] and len(lines) == 2 + len(ROW_BUCKETS)


def test_a_forced_layout_is_not_timed_and_frees_the_unused_copy():
    model = packed_linear.pack_linears(_model())
    weights = linear_weights(model)
    table = tune(weights, "rowblock", measure=lambda w, r: pytest.fail("a forced layout is not timed"))
    assert all(w.plan == ("rowblock",) * len(ROW_BUCKETS) and w.packed is None for w in weights)
    assert "forced" in table.lines()[0]
    with pytest.raises(ValueError, match="linear-layout"):
        tune(weights, "fastest")


def test_measure_times_every_layout_on_the_real_weight():
    seconds = measure([LinearWeight(torch.randn(64, 32)), LinearWeight(torch.randn(64, 32))], rows=4)
    assert set(seconds) == set(LAYOUTS) and all(0 < s < 1 for s in seconds.values())


def test_the_host_table_is_timed_once_and_shared(tmp_path, monkeypatch):
    """auto times once per host and model and stores the table; a second start (the other service)
    loads it without timing; retime times again; a table for other shapes or a corrupt file is not used."""
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    timed = []
    real_tune = linear_tuning.tune

    def counting_tune(weights, mode):
        timed.append(mode)
        return real_tune(
            weights, mode, measure=lambda ws, rows: {"mkl": 3.0, "onednn": 2.0, "rowblock": 1.0, "panels": 4.0}
        )

    monkeypatch.setattr(linear_tuning, "tune", counting_tune)
    # a quiet host whose start-up check agrees with any table (tests/test_layout_table_check.py drives the rest)
    quiet = linear_tuning.Hooks(probe=_QuietProbe(), check_timer=lambda weights, layouts, xs: 1e-3)
    first = linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "auto", hooks=quiet)
    assert timed == ["auto"] and not first.source
    [stored] = list(tmp_path.iterdir())

    other = linear_weights(packed_linear.pack_linears(_model()))  # the second service's own weights
    second = linear_tuning.tune_and_log(other, "auto", hooks=quiet)
    assert timed == ["auto"], "the second start loads the host's table"
    assert str(stored) in second.source and "loaded from" in second.lines()[0]
    assert all(w.plan == ("rowblock",) * len(ROW_BUCKETS) for w in other)
    assert second.chosen_ms == first.chosen_ms

    linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "retime", hooks=quiet)
    assert timed == ["auto", "retime"]

    linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(nn.Linear(8, 24))), "auto", hooks=quiet)
    assert timed == ["auto", "retime", "auto"] and len(list(tmp_path.iterdir())) == 2  # another model

    stored.write_text("{not json")
    linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "auto", hooks=quiet)
    assert timed == ["auto", "retime", "auto", "auto"], "a corrupt table is timed again"
    assert json.loads(stored.read_text())["key"]["host"]  # and rewritten

    for hostile in ("[" * 100_000 + "]" * 100_000, " " * (host_table.MAX_TABLE_BYTES + 1)):  # nested, huge
        stored.write_text(hostile)
        linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "auto", hooks=quiet)
        assert json.loads(stored.read_text())["key"]["host"], "a hostile table is timed again, not fatal"
    assert timed == ["auto", "retime", "auto", "auto", "auto", "auto"]


class _QuietProbe:
    def sample(self):
        return None

    def between(self, a, b):
        return Conditions(cpus=2, seconds=1.0)


def test_a_pinned_table_is_applied_as_it_is_and_a_bad_one_stops_start_up(tmp_path, monkeypatch):
    """fixed.json in the table folder: every weight gets its plan and the greedy head its use, nothing is
    timed and no table is written; `retime` still times; a malformed pin raises, naming the file."""
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    plan = ["mkl", "rowblock", "onednn", "mkl", "rowblock", "onednn", "mkl", "onednn"]
    assert len(plan) == len(packed_linear.ROW_BUCKETS)
    pin = tmp_path / host_table.FIXED
    pin.write_text(json.dumps({"plan": plan, "greedy": [True] + [False] * 7}))
    monkeypatch.setattr(linear_tuning, "tune", lambda *a, **k: pytest.fail("a pinned table is not timed"))
    weights = linear_weights(packed_linear.pack_linears(_model()))
    table = linear_tuning.tune_and_log(weights, "auto")
    assert all(w.plan == tuple(plan) for w in weights) and table.greedy_plan == (True,) + (False,) * 7
    assert "pinned by" in table.lines()[0] and str(pin) in table.lines()[0]
    assert list(tmp_path.iterdir()) == [pin]
    for bad in ({"plan": plan[:3], "greedy": [False] * 8}, {"plan": ["fast"] * 8, "greedy": [False] * 8},
                {"plan": plan, "greedy": [1] * 8}):  # fmt: skip
        pin.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="fixed.json"):
            linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "auto")
    pin.write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        linear_tuning.tune_and_log(linear_weights(packed_linear.pack_linears(_model())), "auto")
