"""GetLoads and GetTokenizer on the decode service."""

from __future__ import annotations

import hashlib
import io
import zipfile

import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.tools.tokenizer import load_tokenizer
from tests.grpc_harness import GrpcPair


def test_get_tokenizer_zip_loads_with_autotokenizer(checkpoint, tmp_path):
    path = checkpoint("llama")
    pair = GrpcPair(path)
    try:
        pieces = list(pair.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
        data = b"".join(p.data for p in pieces)
        assert pieces[-1].sha256 == hashlib.sha256(data).hexdigest()
        assert all(not p.sha256 for p in pieces[:-1])
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            assert "tokenizer.json" in names and all("/" not in n for n in names)
            assert not any(n.endswith(".safetensors") for n in names)
            zf.extractall(tmp_path / "tok")
        ours, theirs = load_tokenizer(str(tmp_path / "tok")), load_tokenizer(path)
        text = "What is the capital of France?"
        assert ours.encode(text) == theirs.encode(text) and ours.chat_template == theirs.chat_template
    finally:
        pair.close()


@pytest.mark.parametrize("reservation", ["full", "on-demand"])
def test_get_loads_counts_running_requests_and_kv(checkpoint, reservation):
    """KV used: prompt + max_new_tokens reserved in full, or on demand the prompt and what it grew to
    (a growth's worth at a time, 32 by default) after its first tokens."""
    pair = GrpcPair(checkpoint("qwen2"), decode_kw=dict(decode_kv_reservation=reservation))
    try:
        idle = pair.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        assert idle.num_running_reqs == 0 and idle.num_used_tokens == 0 and idle.max_total_num_tokens > 0
        call = pair.generate([5, 6, 7], 300, stream=True, ignore_eos=True)
        next(call), next(call)
        busy = pair.stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        used = 303 if reservation == "full" else 3 + 32
        assert busy.num_total_reqs == 1 and busy.num_used_tokens == used and busy.token_usage > 0
        call.cancel()
    finally:
        pair.close()
