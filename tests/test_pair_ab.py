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


def test_restarts_start_both_sides_afresh_before_every_round_and_stop_every_start(monkeypatch, tmp_path):
    started, stopped, runs, logs = [], [], [], []

    def start_pair(path, threads, batch, tokens, **kw):
        procs = [object(), object()]  # decode, prefill
        started.append((kw["tree"], procs))
        logs.append(kw["log_to"])
        return f"addr{len(started)}", procs

    monkeypatch.setattr(pair_ab.serving_bench, "chat_prompt", lambda _: ("model", [1, 2, 3]))
    monkeypatch.setattr(pair_ab.serving_bench, "start_pair", start_pair)
    monkeypatch.setattr(pair_ab.serving_bench, "bench_pair", lambda *a: None)
    monkeypatch.setattr(pair_ab, "stop", stopped.append)
    monkeypatch.setattr(pair_ab, "run", lambda address, *a: runs.append(address) or (1.0, 0.1, 5.0))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    pair_ab.main(["--a", str(a), "--b", str(b), "--rounds", "3", "--new-tokens", "8", "--restarts", "--logs", "L"])
    assert logs == [f"L/{side}-{n}-" for n, side in enumerate("ABABAB")]  # a log per start, none overwritten
    assert len(started) == 6 and [str(t) for t, _ in started] == [str(a), str(b)] * 3
    assert runs == ["addr1", "addr2", "addr4", "addr3", "addr5", "addr6"]  # each round on that round's starts
    assert sorted(map(id, stopped)) == sorted(id(p) for _, procs in started for p in procs)  # each stopped once
    started.clear(), stopped.clear(), runs.clear()
    pair_ab.main(["--a", str(a), "--b", str(b), "--rounds", "3", "--new-tokens", "8"])
    assert len(started) == 2 and runs == ["addr1", "addr2", "addr2", "addr1", "addr1", "addr2"]
    assert len(stopped) == 4
