"""bench.pair_ab: B is put on A's layout table, its own key kept, and only where the plans differ."""

import json

import pytest

from bench import pair_ab


def _table(path, key: str, plan: str) -> str:
    record = {"key": {"rowblock": key}, "plans": [[[960, 576, False], [plan] * 8]], "ms": {"x": [1.0]},
              "chosen_ms": [2.0], "greedy_ms": {"fp32": [3.0]}, "timed_at": key}  # fmt: skip
    path.write_text(json.dumps(record))
    return str(path)


def test_b_takes_a_plans_and_timings_and_keeps_its_key(tmp_path):
    a = _table(tmp_path / "a.json", "gemv A", "panels")
    b = _table(tmp_path / "b.json", "gemv B", "onednn")
    assert pair_ab.take_plans(a, b)
    got = json.loads(open(b).read())
    assert got["plans"] == json.loads(open(a).read())["plans"]
    assert got["key"] == {"rowblock": "gemv B"} and got["timed_at"] == "gemv B"
    assert not pair_ab.take_plans(a, b)  # now the same: B is not restarted


def test_a_side_has_at_most_one_table(tmp_path):
    assert pair_ab.table_file(str(tmp_path)) is None  # w8a8 or a forced layout: no table, nothing to equalize
    _table(tmp_path / "a.json", "gemv A", "panels")
    assert pair_ab.table_file(str(tmp_path)).endswith("a.json")
    _table(tmp_path / "b.json", "gemv B", "panels")
    with pytest.raises(RuntimeError, match="one layout table"):
        pair_ab.table_file(str(tmp_path))
