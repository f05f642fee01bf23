"""Keys from files or the environment, never from a command line a neighbour can read; the launcher's
generated internal key; the layout table's per-user lock and its tolerance of a malformed file."""

from __future__ import annotations

import json
import logging
import os
import stat

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from torch import nn

from common import api_keys
from common.models import host_table, linear_tuning, packed_linear
from common.models.packed_linear import ROW_BUCKETS
from common.tools import demo
from common.tools.client import Client
from common.tools.procs import stop, wait_serving
from common.wire import security
from common.wire.proto_gen import prefill_pb2, prefill_pb2_grpc
from decode_service.config import build_parser as decode_parser
from decode_service.config import parse_args as parse_decode
from decode_service.prefill_replicas import GET_LOAD_METHOD
from decode_service.server import DecodeService
from prefill_service.config import parse_args as parse_prefill
from prefill_service.server import PrefillService
from tests.grpc_harness import wait_for
from tests.oracle import hf_greedy

PROMPT = [5, 6, 7, 8]


def _key_file(tmp_path, name: str, text: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def _refused(call) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_keys_from_a_file_and_the_environment_reach_the_services(checkpoint, tmp_path, monkeypatch):
    """prefill reads its internal key from a file, decode the same key from the environment and its
    front-door key from a file: keyless calls are refused on both, keyed ones served exactly."""
    path = checkpoint("llama")
    internal = _key_file(tmp_path, "internal", "inside-key\n")
    outside = _key_file(tmp_path, "outside", "outside-key\r\n", 0o440)  # group read is allowed
    prefill_config = parse_prefill(["--model-path", path, "--port", "0", "--internal-api-key-file", internal])
    assert prefill_config.internal_api_key == "inside-key" and "inside-key" not in repr(prefill_config)
    prefill = PrefillService(prefill_config).start()
    monkeypatch.setenv("DISAGG_INTERNAL_API_KEY", "inside-key")
    decode_config = parse_decode(
        ["--model-path", path, "--port", "0", "--prefill-addr", prefill.address, "--api-key-file", outside]
    )
    assert decode_config.api_key == "outside-key" and decode_config.internal_api_key == "inside-key"
    assert "-key" not in repr(decode_config)
    decode = DecodeService(decode_config).start()
    try:
        stub = pb_grpc.SglangSchedulerStub(grpc.insecure_channel(decode.address))
        wait_for("decode never reached prefill with the key", lambda: stub.HealthCheck(pb.HealthCheckRequest()).healthy)
        _refused(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10))
        client = Client(decode.address, api_key="outside-key")
        assert [t for c in client.generate_ids(PROMPT, 4, ignore_eos=True) for t in c] == hf_greedy(path, PROMPT, 4)
        inner = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill.address))
        _refused(lambda: inner.GetLoad(prefill_pb2.LoadRequest(), timeout=10))
    finally:
        decode.stop()
        prefill.stop()


def test_a_key_file_others_may_read_or_change_is_refused(tmp_path, capsys):
    for mode in (0o644, 0o604, 0o620, 0o666):
        path = _key_file(tmp_path, f"k{mode:o}", "secret\n", mode)
        with pytest.raises(api_keys.KeySourceError, match=f"chmod 600 {path}"):
            api_keys.read_key_file(path)
    loose = _key_file(tmp_path, "loose", "secret\n", 0o644)
    with pytest.raises(SystemExit) as exit_:  # the service does not start, and says why
        parse_prefill(["--model-path", "m", "--internal-api-key-file", loose])
    assert exit_.value.code == 2 and "other users may read or change it (mode 0644)" in capsys.readouterr().err
    assert api_keys.read_key_file(_key_file(tmp_path, "tight", "secret\n", 0o400)) == "secret"


def test_key_files_that_hold_no_usable_key_are_refused(tmp_path):
    cases = {
        "empty": ("", "empty"),
        "newline": ("\n", "empty"),
        "spaces": ("two words\n", "printable ASCII"),
        "lines": ("one\ntwo\n", "printable ASCII"),
        "huge": ("k" * (api_keys.MAX_BYTES + 1), "larger than"),
    }
    for name, (text, why) in cases.items():
        with pytest.raises(api_keys.KeySourceError, match=why):
            api_keys.read_key_file(_key_file(tmp_path, name, text), "--internal-api-key-file")
    with pytest.raises(api_keys.KeySourceError, match="cannot open"):
        api_keys.read_key_file(str(tmp_path / "missing"))
    with pytest.raises(api_keys.KeySourceError, match="not a regular file"):
        api_keys.read_key_file(str(tmp_path))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(api_keys.KeySourceError, match="not a regular file"):  # refused, not waited on
        api_keys.read_key_file(str(fifo))


def test_which_source_gives_the_key():
    env = {"DISAGG_INTERNAL_API_KEY": "from-env"}
    assert api_keys.resolve("internal_api_key", None, None, env) == "from-env"
    assert api_keys.resolve("internal_api_key", "from-flag", None, env) == "from-flag"
    assert api_keys.resolve("api_key", None, None, env) is None  # each key has its own variable
    assert api_keys.resolve("internal_api_key", "", None, {}) is None  # an empty value: no key, as before
    with pytest.raises(api_keys.KeySourceError, match="not both"):
        api_keys.resolve("internal_api_key", "from-flag", "/some/file", {})
    with pytest.raises(api_keys.KeySourceError, match="set but empty"):
        api_keys.resolve("internal_api_key", None, None, {"DISAGG_INTERNAL_API_KEY": ""})
    helptext = decode_parser().format_help()
    assert "--api-key-file" in helptext and "--internal-api-key-file" in helptext
    assert helptext.count("Prefer --") == 2 and "DISAGG_API_KEY" in helptext  # files preferred over values


def test_the_launcher_shares_a_generated_key_off_the_command_line(checkpoint, monkeypatch):
    monkeypatch.delenv("DISAGG_INTERNAL_API_KEY", raising=False)
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    prefill, decode, prefill_port, decode_port = demo.start_pair(checkpoint("llama"), ["--torch-threads", "1"])
    try:
        wait_serving(f"127.0.0.1:{prefill_port}", prefill)
        wait_serving(f"127.0.0.1:{decode_port}", decode)
        keys = []
        for proc in (prefill, decode):
            environ = open(f"/proc/{proc.pid}/environ", "rb").read().split(b"\0")
            [key] = [v.split(b"=", 1)[1] for v in environ if v.startswith(b"DISAGG_INTERNAL_API_KEY=")]
            assert len(key) >= 32 and key not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
            keys.append(key.decode())
        assert keys[0] == keys[1]  # one key for the pair, fresh per launch
        inner = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(f"127.0.0.1:{prefill_port}"))
        _refused(lambda: inner.GetLoad(prefill_pb2.LoadRequest(), timeout=10))
        bearer = (("authorization", f"Bearer {keys[0]}"),)  # the key itself admits nothing: it is never sent
        _refused(lambda: inner.GetLoad(prefill_pb2.LoadRequest(), metadata=bearer, timeout=10))
        inner.GetLoad(
            prefill_pb2.LoadRequest(), metadata=security.signed_metadata(keys[0], GET_LOAD_METHOD), timeout=10
        )
        client = Client(f"127.0.0.1:{decode_port}")
        assert sum(len(c) for c in client.generate_ids(PROMPT, 3, ignore_eos=True)) == 3  # decode sends the key
        client.close()
    finally:
        assert (stop(decode), stop(prefill)) == (0, 0)


def _timing_tune(monkeypatch) -> list[str]:
    timed, real_tune = [], linear_tuning.tune

    def counting_tune(weights, mode):
        timed.append(mode)
        return real_tune(
            weights, mode, measure=lambda ws, rows: {"mkl": 3.0, "onednn": 2.0, "rowblock": 1.0, "panels": 4.0}
        )

    monkeypatch.setattr(linear_tuning, "tune", counting_tune)
    return timed


def _weights():
    return packed_linear.linear_weights(packed_linear.pack_linears(nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))))


def test_a_malformed_table_file_is_ignored_with_a_warning_and_timed_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(host_table.ENV_DIR, str(tmp_path))
    timed = _timing_tune(monkeypatch)
    linear_tuning.tune_and_log(_weights(), "auto")
    [stored] = list(tmp_path.iterdir())
    good = json.loads(stored.read_text())
    broken = [
        "[]",
        "null",
        '"a table"',
        "{not json",
        json.dumps({k: v for k, v in good.items() if k != "ms"}),
        json.dumps({k: v for k, v in good.items() if k != "chosen_ms"}),
        json.dumps({k: v for k, v in good.items() if k != "timed_at"}),
        json.dumps({**good, "ms": {"mkl": [1.0]}}),
        json.dumps({**good, "chosen_ms": ["fast"] * len(ROW_BUCKETS)}),
        json.dumps({**good, "plans": {"a": 1}}),
        json.dumps({**good, "plans": [[]]}),
    ]
    for text in broken:
        stored.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=host_table.__name__):
            table = linear_tuning.tune_and_log(_weights(), "auto")  # start-up goes on
        assert timed[-1] == "auto" and not table.source, text
        assert "unusable" in caplog.text and "timing again" in caplog.text, text
    assert len(timed) == 1 + len(broken)
    assert linear_tuning.tune_and_log(_weights(), "auto").source  # the rewritten table is loaded again


def test_the_table_lock_is_the_users_own(tmp_path, monkeypatch, caplog):
    """The lock lives in the user's cache folder (0700, the file 0600), not under a fixed name in the
    shared temp folder, and a symlink planted in its place is not followed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / ".cache" / "disagg-serve" / "linear-tuning.lock"
    with host_table.host_wide_lock():
        assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.unlink()
    target = tmp_path / "elsewhere"
    path.symlink_to(target)
    with caplog.at_level(logging.WARNING, logger=host_table.__name__), host_table.host_wide_lock():
        pass  # still runs, without the lock
    assert not target.exists() and "lock" in caplog.text and str(path) in caplog.text
