"""--enable-torch-compile (common/models/compiled_layers.py): small decode batches run the layer stack
through torch.compile, token for token with HF; warm-up compiles every row bucket up to the largest
batch, so serving compiles nothing more; larger batches and other forwards stay eager; set-ups it
was not built for are refused at start-up."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from common.engine.model_runner import RunnerArgs
from common.engine.sampling import SamplingParams
from common.forward.forward_batch import ForwardBatch
from common.models import compiled_layers
from common.models.packed_linear import bucket_index
from decode_service.config import DecodeConfig
from prefill_service.config import PrefillConfig
from tests.decode_harness import Pair
from tests.oracle import hf_greedy


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("arch,layout", [("llama", "onednn"), ("qwen3", "auto")])
def test_decode_through_torch_compile_matches_hf(checkpoint, arch, layout, monkeypatch):
    """Up to 4 requests decode through the compiled layers (a forced oneDNN layout runs as MKL
    inside the graph); 3 requests run in the graph compiled at warm-up for 4, so serving compiles
    nothing more; every answer equals HF's."""
    monkeypatch.setattr(compiled_layers, "KEEP_SLOWER", True)  # tiny models: the timing may go either way
    path = checkpoint(arch)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 384, (n,), generator=g).tolist() for n in (3, 17, 9)]
    pair = Pair(path, torch_compile_max_bs=4, linear_layout=layout)
    compiled = pair.worker.runner.model.compiled_layers
    assert compiled.max_bs == 4 and compiled.buckets == {0, 1, 2}
    sizes, real = [], compiled._fn
    compiled._fn = lambda x, *a: sizes.append(x.shape[0]) or real(x, *a)
    graphs = _graphs_compiled()
    try:
        pair.submit("0", prompts[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
        pair.wait(["0"])
        for i, p in enumerate(prompts):  # long enough that the three overlap whatever the prefill's pace
            pair.submit(f"b{i}", p, SamplingParams(max_new_tokens=48, ignore_eos=True))
        pair.wait([f"b{i}" for i in range(3)])
    finally:
        pair.close()
    assert pair.out.tokens["0"] == hf_greedy(path, prompts[0], 12)
    for i, p in enumerate(prompts):
        assert pair.out.tokens[f"b{i}"] == hf_greedy(path, p, 48), f"prompt {i}"
    assert sizes.count(1) >= 11, "the lone request's steps ran compiled"
    assert 3 in sizes, "three requests ran in the graph compiled for four"
    assert _graphs_compiled() == graphs, "warm-up compiled every bucket: serving compiled nothing more"


def test_each_bucket_keeps_its_graph_only_where_timed_faster():
    """Made-up timings: compiled is 20% faster at 1 request, 1% (noise) at 2 and slower at 3-4, so
    only bucket 0 stays."""
    compiled = compiled_layers.CompiledLayers(lambda *a: a[0], 4)
    assert compiled.buckets == set(), "nothing runs compiled before warm-up"
    clock, compiles = [0.0], []

    def time_one(batch):  # a forward costs 10 ms eager; compiled 8 ms at 1 request, 9.9 at 2, 12 above
        on = bucket_index(batch) in compiled.buckets
        clock[0] += 0.010 if not on else {1: 0.008, 2: 0.0099}.get(batch, 0.012)

    with patch.object(compiled_layers.time, "perf_counter", lambda: clock[0]):
        compiled_layers.compile_and_time(compiled, compiles.append, time_one)
    assert compiles == [1, 2, 4]
    assert compiled.buckets == {0}
    assert compiled.timings[1] == pytest.approx((10.0, 8.0)) and compiled.timings[4] == pytest.approx((10.0, 12.0))
    assert compiled.used_for(_decode(1)) and not compiled.used_for(_decode(2))


def _decode(batch: int) -> ForwardBatch:
    table, rows = torch.zeros(8, 8, dtype=torch.int32), list(range(batch))
    return ForwardBatch.decode(table, torch.tensor(rows), [1] * batch, torch.zeros(batch, dtype=torch.int64),
                               req_pool_indices_cpu=rows)  # fmt: skip


def test_a_failed_compile_stops_the_start_with_a_clear_error():
    compiled = compiled_layers.CompiledLayers(lambda *a: a[0], 1)

    def compile_one(batch):
        raise OSError("no C++ compiler found")

    with pytest.raises(RuntimeError, match="enable-torch-compile.*no C.. compiler found.*without the flag"):
        compiled_layers.compile_and_time(compiled, compile_one, lambda b: None)


def test_warm_up_covers_each_row_bucket_once():
    assert compiled_layers.warm_batches(1) == [1]
    assert compiled_layers.warm_batches(3) == [1, 2, 3]
    assert compiled_layers.warm_batches(8) == [1, 2, 4, 8]
    assert compiled_layers.warm_batches(12) == [1, 2, 4, 8, 12]


def test_unsupported_set_ups_are_refused():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    compiled_layers.check_usable(cpu, "batched", 1, False)
    refused = [(cuda, "batched", 1, False), (cpu, "torch", 1, False), (cpu, "batched", 2, False)]
    for args in refused + [(cpu, "batched", 1, True)]:
        with pytest.raises(ValueError, match="torch-compile"):
            compiled_layers.check_usable(*args)
    for max_bs in (0, compiled_layers.MAX_BS + 1):
        with pytest.raises(ValueError, match="from 1 to 8"):
            compiled_layers.CompiledLayers(lambda *a: a[0], max_bs)


def test_the_flags_reach_the_decode_runner_only():
    on = DecodeConfig(model_path="m", enable_torch_compile=True, torch_compile_max_bs=4)
    assert RunnerArgs.from_service_config(on).torch_compile_max_bs == 4
    assert RunnerArgs.from_service_config(DecodeConfig(model_path="m")).torch_compile_max_bs == 0
    assert RunnerArgs.from_service_config(PrefillConfig(model_path="m")).torch_compile_max_bs == 0
