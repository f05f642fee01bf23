"""The CPU side of the CUDA path's fixes (tests/gpu runs them on a GPU): host copies, no aliasing of
the batch's seq_lens mirror, event waits that poll with backoff and honour their timeout."""

from __future__ import annotations

import pytest
import torch

from common.engine import streams
from common.engine.streams import poll_until
from common.forward.forward_batch import ForwardBatch
from common.forward.host_copy import to_device


def test_to_device_on_cpu_is_the_host_tensor_with_the_dtype():
    t = torch.tensor([1, 2, 3])
    assert to_device(t, "cpu") is t
    assert to_device([1, 2], "cpu", torch.int32).dtype == torch.int32
    assert to_device(t, "cpu", torch.float32).tolist() == [1.0, 2.0, 3.0]


def test_decode_batch_positions_do_not_alias_the_callers_seq_lens():
    table = torch.arange(40, dtype=torch.int32).view(2, 20)
    seq_lens = torch.tensor([3, 7])
    fb = ForwardBatch.decode(
        table, torch.tensor([0, 1]), [3, 7], torch.tensor([5, 6]), seq_lens, req_pool_indices_cpu=[0, 1]
    )
    assert fb.positions.data_ptr() != seq_lens.data_ptr()
    fb.positions.add_(100)  # whatever a forward does to its positions...
    assert seq_lens.tolist() == [3, 7]  # ...never reaches the scheduler's mirror
    assert fb.out_cache_loc.tolist() == [3, 27] and fb.seq_lens.tolist() == [4, 8]


class _FakeClock:
    """time.monotonic / time.sleep for poll_until: a sleep advances the clock by exactly what was asked,
    so the pauses and the timeout are checked without the machine's timing."""

    def __init__(self):
        self.now, self.pauses = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert len(self.pauses) < 10_000, "poll_until never gave up"
        self.pauses.append(seconds)
        self.now += seconds


def test_poll_until_backs_off_and_honours_the_timeout(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(streams, "time", clock)
    calls = []
    with pytest.raises(TimeoutError):
        poll_until(lambda: calls.append(clock.now) is not None, timeout=0.1)  # never true
    backoff = [50e-6 * 2**i for i in range(6)]  # 50 us doubling up to the 2 ms cap
    assert clock.pauses[:7] == pytest.approx(backoff + [2e-3]), clock.pauses[:8]
    assert all(p == pytest.approx(2e-3) for p in clock.pauses[6:-1]) and 0 < clock.pauses[-1] <= 2e-3
    assert clock.now == pytest.approx(100.1) and len(calls) == len(clock.pauses) + 1  # gave up at its timeout
    assert 50 < len(calls) < 60, len(calls)  # 0.5 ms polling would have made ~200 calls
    clock = _FakeClock()
    monkeypatch.setattr(streams, "time", clock)
    poll_until(lambda: clock.now >= 100.02, timeout=5)  # true 20 ms in: seen at the next poll
    assert 100.02 <= clock.now <= 100.02 + 2e-3 and clock.pauses[-1] <= 2e-3


def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    """The one-command GPU check (tests + bench + summary) on a tiny model, so it is ready for a GPU."""
    import json

    from bench import gpu_check

    code = gpu_check.main(
        [
            "--out-dir",
            str(tmp_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--shapes",
            "tiny",
            "--batch-sizes",
            "1,2",
            "--new-tokens",
            "6",
            "--prompt-len",
            "12",
        ]
    )
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and summary["tests_ok"], summary["tests"]
    assert [r["batch"] for r in summary["bench"]] == [1, 2]
    assert all(r["hf_ms"] > 0 and r["ours_ms"] > 0 and r["floor_ms"] > 0 for r in summary["bench"])


def test_gpu_check_fails_on_a_gpu_when_no_test_ran():
    from bench.gpu_check import tests_ok

    assert not tests_ok(0, "16 skipped, 2 deselected in 0.3s", on_gpu=True)  # CUDA not seen: not a pass
    assert not tests_ok(5, "no tests ran in 0.01s", on_gpu=True)
    assert not tests_ok(1, "1 failed, 15 passed in 21s", on_gpu=True)
    assert tests_ok(0, "19 passed, 2 deselected in 24s", on_gpu=True)
    assert tests_ok(0, "16 skipped, 2 deselected in 0.3s", on_gpu=False)  # the CPU rehearsal
    assert not tests_ok(1, "1 failed, 16 skipped in 0.3s", on_gpu=False)


def test_to_host_keeps_host_tensors_as_they_are():
    from common.forward.host_copy import to_host

    t = torch.tensor([4, 5])
    assert to_host(t) is t
