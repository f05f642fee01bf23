"""The KV transport's interface (common/kv_transfer/): one factory per side picks the backend, each
sender says where the prefill worker stages the copy-out and falls back to bytes by itself, and
whatever goes wrong while the KV moves is one error type. The CUDA half (device staging, Mooncake reading
device memory) is tests/gpu/test_kv_transfer_cuda.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from common.engine.handoff import Handoff, HandoffRequest
from common.engine.kv_pool import KVPool
from common.engine.model_runner import ModelRunner, RunnerArgs
from common.engine.sampling import SamplingParams
from common.kv_transfer import grpc_bytes, mooncake, plan, receiver, sender, shm, shm_files, staging
from common.kv_transfer.errors import KvTransferError
from common.wire import kv_capability
from common.wire.kv_chunks import KvAssembler
from common.wire.proto_gen import prefill_pb2
from prefill_service.worker import PrefillWorker

CUDA0 = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


def _config(backend: str, tmp_path, device: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(
        disaggregation_transfer_backend=backend,
        disaggregation_shm_dir=str(tmp_path),
        internal_api_key=None,
        host="127.0.0.1",
        disaggregation_protocol="tcp",
        disaggregation_ib_device="",
        disaggregation_network_private=True,  # the tests' loopback
        device=device,
    )


def test_each_sender_stages_where_its_backend_reads():
    """Bytes and shm read the KV with the CPU: host memory whatever the pool's device. Mooncake reads
    it where the pool is (on CUDA the engine registers device memory: no host copy)."""
    for s in (grpc_bytes.BytesSender(), shm.ShmSender(shm.ShmWriter("/nonexistent"))):
        assert s.staging_device(CUDA0) == torch.device("cpu") and s.staging_device("cpu") == torch.device("cpu")
    moon = mooncake.MooncakeSender(transfer_engine=None)  # no engine started: the choice alone
    assert moon.staging_device(CUDA0) == CUDA0 and moon.staging_device("cpu") == torch.device("cpu")
    # over RDMA the engine reads device memory itself (GPUDirect); over TCP the transfer thread copies it out
    assert mooncake.MooncakeSender(SimpleNamespace(protocol="rdma")).reads_device and not moon.reads_device


def test_the_factories_pick_the_backend_by_the_flag(tmp_path):
    made = sender.make_sender(_config("grpc", tmp_path))
    assert isinstance(made, grpc_bytes.BytesSender) and made.label == "grpc"
    made = sender.make_sender(_config("shm", tmp_path))
    assert isinstance(made, shm.ShmSender) and made.label == "shm"
    made.close()
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        sender.make_sender(_config("carrier-pigeon", tmp_path))
    bytes_side = receiver.make_receiver(None, _config("grpc", tmp_path))
    assert bytes_side.destination is None and bytes_side.keys is None  # KV comes as bytes: nothing named
    allocate = receiver.pool_memory(_config("shm", tmp_path))  # decode's pools as files there
    path, buffer = allocate((2, 3), torch.float32)
    assert os.path.dirname(path) == os.path.realpath(tmp_path) and buffer.shape == (2, 3)
    assert (
        receiver.pool_memory(_config("grpc", tmp_path)) is None
        and receiver.pool_memory(_config("mooncake", tmp_path)) is None
    )
    receiver.check(_config("grpc", tmp_path, device="cuda"))
    with pytest.raises(ValueError, match="for CPU services on one host"):
        receiver.check(_config("shm", tmp_path, device="cuda"))


def _kv(tokens: int = 6, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k = torch.randn(layers, tokens, 1, 4)
    return list(k), list(k + 1)


def _handoff(rid: str = "r", tokens: int = 6) -> Handoff:
    k, v = _kv(tokens)
    return Handoff(rid, list(range(tokens)), None, 0, 3, k, v)


def test_a_sender_falls_back_to_bytes_by_itself(tmp_path):
    """No destination, or one this replica does not reach: the KV itself, as chunks that assemble
    back into the handoff's KV; the label says which path ran."""
    handoff = _handoff()
    unreachable = prefill_pb2.KvDestination(session="127.0.0.1:1")
    shm_sender = shm.ShmSender(shm.ShmWriter(str(tmp_path)))
    for s, dest in ((shm_sender, None), (shm_sender, unreachable), (grpc_bytes.BytesSender(), unreachable)):
        label, messages = s.messages("r", dest, handoff, 1 << 10, lambda: False)
        assembler = KvAssembler(6, 2, 1, 4)
        for m in messages:
            assembler.add(m.kv)
        k, v = assembler.finish()
        assert label == "grpc" and all(torch.equal(a, b) for a, b in zip(k + v, handoff.k + handoff.v))
    shm_sender.close()


def test_a_destination_that_does_not_fit_is_a_transfer_error(tmp_path):
    """The server catches one type: a destination of the wrong shape (a ValueError of the planning)
    comes out of the messages as KvTransferError, with the planning's error as its cause."""
    pool = KVPool(8, 3, 1, 4, torch.float32, allocate=shm_files.allocator(str(tmp_path)))  # 3 layers: the handoff has 2
    endpoint = shm.ShmEndpoint(pool.files)
    dest = prefill_pb2.KvDestination(session=endpoint.session, target=plan.kv_region(pool.k, pool.v))
    dest.runs.extend(plan.slot_runs(list(range(1, 7))))
    kv_capability.sign(dest, "r", [endpoint.key], 60)
    s = shm.ShmSender(shm.ShmWriter(str(tmp_path)))
    label, messages = s.messages("r", dest, _handoff(), 1 << 20, lambda: False)
    assert label == "shm"
    with pytest.raises(KvTransferError, match="layers") as refused:
        next(messages)
    assert isinstance(refused.value.__cause__, ValueError) and not pool.k_all.any()
    assert issubclass(shm.ShmTransferError, KvTransferError) and issubclass(mooncake.TransferFailed, KvTransferError)
    s.close()


def test_host_staging_leaves_the_copy_out_as_it_was(checkpoint):
    """The prefill worker copies a finished prompt's KV to its staging device. On the host (every CPU
    service, and gRPC or shm on a GPU) the handoff holds host tensors equal to the pool's slots and
    nothing to wait for; another staging device gets the KV there (the meta device stands in for a
    GPU here: it holds shapes, no data)."""
    runner = ModelRunner(RunnerArgs(checkpoint("llama"), max_total_tokens=64, max_running_requests=2))
    prompt = list(range(5, 17))
    request = HandoffRequest("r", prompt, SamplingParams(max_new_tokens=1), 0)
    worker = PrefillWorker(runner, chunk_size=64, radix_cache=True)
    assert worker.staging == torch.device("cpu")
    [handoff] = worker.prefill([request])
    assert handoff.kv_ready is None and all(t.device.type == "cpu" for t in handoff.k + handoff.v)
    slots = worker.cache.match_prefix(prompt)[0]  # the prompt's slots, kept by the radix cache
    assert torch.equal(torch.stack(handoff.k), runner.kv_pool.k_all[:, slots])
    assert staging.host_handoff(handoff) is handoff  # the bytes path copies nothing more
    elsewhere = PrefillWorker(runner, chunk_size=64, radix_cache=False, staging="meta")
    [moved] = elsewhere.prefill([HandoffRequest("m", prompt, SamplingParams(max_new_tokens=1), 0)])
    assert moved.kv_ready is None and all(t.device.type == "meta" for t in moved.k + moved.v)
    assert moved.k[0].shape == handoff.k[0].shape and moved.first_token == handoff.first_token


def test_a_prefill_service_stages_as_its_sender_says(checkpoint, tmp_path):
    from prefill_service.config import PrefillConfig
    from prefill_service.server import PrefillService

    for backend in ("grpc", "shm"):
        config = PrefillConfig(
            checkpoint("qwen2"), port=0, disaggregation_transfer_backend=backend, disaggregation_shm_dir=str(tmp_path)
        )
        service = PrefillService(config).start()
        try:
            assert service.sender.label == backend and service.worker.staging == torch.device("cpu")
        finally:
            service.stop(0)
            service.sender.close()
