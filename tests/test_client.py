"""The client library and CLI against an in-process pair."""

from __future__ import annotations

from common.models.config import load_model_config
from common.tools import client as client_cli
from common.tools.client import Client
from common.tools.tokenizer import load_tokenizer
from tests.grpc_harness import GrpcPair
from tests.oracle import hf_greedy


def test_text_and_ids_through_the_client(checkpoint, capsys):
    path = checkpoint("qwen2")
    pair = GrpcPair(path)
    try:
        tok = load_tokenizer(path)
        client = Client(pair.decode.address)
        prompt = "Hello, world! How are you today?"
        text = "".join(client.generate_text(prompt, max_new_tokens=12, ignore_eos=True))
        ref_ids = hf_greedy(path, tok.encode(prompt), 12)
        assert text == tok.decode(ref_ids, skip_special_tokens=True)
        assert client.last_complete.completion_tokens == 12
        non_stream = list(client.generate_ids([5, 6, 7], 6, stream=False, ignore_eos=True))
        assert non_stream == [hf_greedy(path, [5, 6, 7], 6)]
        client.close()
        assert client_cli.main(["--addr", pair.decode.address, "--ids", "5,6,7", "--max-new-tokens", "6"]) == 0
        out = capsys.readouterr().out
        printed = [int(x) for x in out.split("[")[0].split()]
        ref = hf_greedy(path, [5, 6, 7], 6)
        eos = [i for i, t in enumerate(ref) if t in load_model_config(path).eos_token_ids]
        assert printed == (ref[: eos[0] + 1] if eos else ref)
        assert client_cli.main(["--addr", pair.decode.address, "--ids", ""]) == 1  # INVALID_ARGUMENT reported
    finally:
        pair.close()
