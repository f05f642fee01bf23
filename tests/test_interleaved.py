"""interleaved: the rounds' rotated order, and each alternative's median ratio to the base within its rounds."""

import pytest

from common.models import interleaved


def test_each_round_starts_one_further_and_every_name_runs_once():
    names = ["a", "b", "c"]
    assert [interleaved.rotated(names, r) for r in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]


def test_ratios_pair_each_round_with_the_bases_and_a_dropped_name_counts_its_own_rounds():
    times = {
        "base": [1.0, 2.0, 2.0, 1.0, 2.0],  # the host's speed moves between rounds
        "fast": [0.9, 1.8, 1.8, 0.9, 1.8],  # 0.9 of the base in every round
        "dropped": [1.5, 3.0, 4.0],  # timed in rounds 0-2 only: 1.5, 1.5, 2.0
    }
    ratio = interleaved.median_ratios(times, "base")
    assert ratio == pytest.approx({"base": 1.0, "fast": 0.9, "dropped": 1.5})


def test_rounds_faster_counts_the_rounds_where_a_name_beat_the_base():
    times = {"base": [1.0, 2.0, 2.0], "a": [0.9, 2.1, 1.9], "b": [0.5]}  # b: dropped after one round
    assert interleaved.rounds_faster(times, "base") == {"base": 0, "a": 2, "b": 1}
