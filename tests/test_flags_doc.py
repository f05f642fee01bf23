"""The flags in groups: docs/flags.md is what the generator writes, `--help` reads in one section
per group, and every flag still parses from the command line, from a YAML file and as a keyword."""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import fields

import pytest
import yaml

from common.service_config import flag_sections
from common.tools import flags_doc
from decode_service import config as decode
from prefill_service import config as prefill

SHARED = ["model", "server", "capacity", "parallel", "speculative", "transfer", "security", "observability"]
SERVICES = {  # name: (config module, config class, its sections in --help order)
    "prefill": (prefill, prefill.PrefillConfig, SHARED + ["scheduler", "prefill calls"]),
    "decode": (decode, decode.DecodeConfig, SHARED + ["prefill client", "scheduler", "decode steps", "front door"]),
}


def test_docs_flags_md_is_current():
    with open(flags_doc.DEFAULT_PATH) as f:
        written = f.read()
    wanted = flags_doc.render()
    diff = "".join(difflib.unified_diff(written.splitlines(True), wanted.splitlines(True), "docs/flags.md", "wanted"))
    assert written == wanted, f"docs/flags.md is stale: regenerate it with `{flags_doc.COMMAND}`\n{diff[:3000]}"


@pytest.mark.parametrize("service", SERVICES)
def test_help_reads_in_one_section_per_group(service):
    module, cls, titles = SERVICES[service]
    sections = flag_sections(cls)
    assert [title for title, _, _ in sections] == titles
    parser = module.build_parser()
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    helptext = parser.format_help()
    for title, about, group_fields in sections:
        assert groups[title] == [f.name for f in group_fields], title
        assert f"\n{title}:\n  {about.split()[0]} " in helptext, title  # the heading, then its description
    config_fields = [f.name for f in fields(cls)]
    assert sorted(n for _, _, fs in sections for n in (f.name for f in fs)) == sorted(config_fields)
    for name in config_fields:  # each flag in its own section, none among the general options
        assert name not in groups["options"]


def _other_value(f, tmp_path):
    """A value of the field's flag other than its default: (command-line text, parsed value)."""
    meta, default = f.metadata, f.default
    if f.name.endswith("api_key_file"):
        path = tmp_path / "key"
        path.write_text("k3y\n")
        path.chmod(0o600)
        return str(path), str(path)
    if meta["choices"]:
        choice = next(c for c in meta["choices"] if c != default)
        return str(choice), choice
    kind = str(f.type).split(" | ")[0]  # as the field is annotated ("int | None": an int), not as the flag says
    value = {"int": 7, "float": 2.5, "str": f"x-{f.name}"}[kind]
    return str(value), value


CASES = [(service, f.name) for service, (_, cls, _) in SERVICES.items() for f in fields(cls)]


@pytest.mark.parametrize("service,name", CASES)
def test_every_flag_parses(service, name, tmp_path, monkeypatch):
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    monkeypatch.delenv("DISAGG_INTERNAL_API_KEY", raising=False)
    module, cls, _ = SERVICES[service]
    f = next(f for f in fields(cls) if f.name == name)
    option = "--" + name.replace("_", "-")
    base = [] if name == "model_path" else ["--model-path", "m"]
    if isinstance(f.default, bool):  # a switch, or for one on by default its --no- form
        argv, value = base + ["--no-" + option[2:] if f.default else option], not f.default
    else:
        text, value = _other_value(f, tmp_path)
        argv = base + [option, text]
    expected = cls(**{"model_path": "m", name: value})  # flat keywords, as callers construct configs
    assert getattr(expected, name) == value
    assert module.parse_args(argv) == expected
    path = tmp_path / "flags.yaml"  # the YAML key: the flag without its dashes
    path.write_text(yaml.safe_dump({option[2:]: value}))
    assert module.parse_args(["--config", str(path)] + base) == expected
    assert module.parse_args(base or [option, "m"]) == cls("m")  # without the flag: its default
    if f.metadata["choices"]:
        with pytest.raises(SystemExit):
            module.parse_args(base + [option, "no-such-choice"])


def test_model_path_alone_is_positional():
    assert prefill.PrefillConfig("m", port=0, max_chunk_bytes=1024).max_chunk_bytes == 1024
    assert decode.DecodeConfig("m").model_path == "m"
    with pytest.raises(TypeError):
        prefill.PrefillConfig("m", 0)


def test_the_generator_writes_the_file(tmp_path):
    out = tmp_path / "docs" / "flags.md"
    assert flags_doc.main([str(out)]) == 0
    assert out.read_text() == flags_doc.render() and os.path.getsize(out) > 0
    assert argparse.SUPPRESS not in out.read_text()
    for test_hook in ("--inject-faults", "--test-kv-chunk-delay-s", "--test-step-delay-s"):  # objects, not flags
        assert test_hook not in out.read_text()


def test_the_check_mode_writes_nothing_and_says_whether_the_file_is_current(tmp_path):
    out = tmp_path / "flags.md"
    assert flags_doc.main(["--check", str(out)]) == 1 and not out.exists()  # missing: not current
    out.write_text(flags_doc.render())
    assert flags_doc.main([str(out), "--check"]) == 0
    out.write_text(flags_doc.render() + "stale line\n")
    assert flags_doc.main(["--check", str(out)]) == 1
