"""`--config FILE.yaml` on both services: the file's values, the command line over them, and
clear errors for keys or values the flags would refuse."""

import pytest

from decode_service.config import parse_args as parse_decode
from prefill_service.config import parse_args as parse_prefill


def test_file_values_then_flags_override(tmp_path):
    cfg = tmp_path / "decode.yaml"
    cfg.write_text(
        "model-path: /models/m\nmax_total_tokens: 4096\nprefill-addr: 10.0.0.1:30001,10.0.0.2:30001\n"
        "disable-overlap-schedule: true\nattention-backend: torch\nprefill-policy: least_loaded\n"
    )
    c = parse_decode(["--config", str(cfg), "--max-total-tokens", "2048"])
    assert c.model_path == "/models/m" and c.max_total_tokens == 2048  # the flag wins
    assert c.prefill_addrs == ["10.0.0.1:30001", "10.0.0.2:30001"] and c.disable_overlap_schedule
    assert c.attention_backend == "torch" and c.prefill_policy == "least_loaded"
    assert parse_decode(["--model-path", "/x"]).max_total_tokens == 16384  # no file: the defaults
    p = tmp_path / "prefill.yaml"
    p.write_text("model_path: /models/m\nchunked-prefill-size: 256\ndisable-radix-cache: true\n")
    c = parse_prefill(["--config", str(p)])
    assert c.chunked_prefill_size == 256 and c.disable_radix_cache and c.port == 30001


@pytest.mark.parametrize(
    "text,message",
    [
        ("model-path: m\nmax-totl-tokens: 5\n", "unknown key 'max-totl-tokens'"),
        ("model-path: m\nmax-total-tokens: lots\n", "invalid value 'lots'"),
        ("model-path: m\nattention-backend: flash\n", "must be one of"),
        ("model-path: m\ndebug-checks: maybe\n", "takes true or false"),
        ("- a list\n", "expected a mapping"),
        ("model-path: [unclosed\n", "--config"),
    ],
)
def test_bad_files_are_refused_with_the_reason(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        parse_decode(["--config", str(cfg)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_required_flag_is_still_required(tmp_path, capsys):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("port: 1234\n")
    with pytest.raises(SystemExit):
        parse_decode(["--config", str(cfg)])
    assert "--model-path" in capsys.readouterr().err
