"""Service configuration, declared once: each field of a config dataclass is one CLI flag.

`flag(default, help)` declares a field with its help text; `build_parser(cls)` turns the dataclass
into an argparse parser (`model_path` -> `--model-path`; bools are switches; a field without a
default is required), and `parse_config(cls, argv)` returns the dataclass. `ServiceConfig` holds the
flags both services share (same names, same meaning); each service subclasses it, overriding a
default where its role differs.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from common import api_keys
from common.attention import CHOICES as ATTENTION_CHOICES
from common.models.linear_tuning import CHOICES as LAYOUT_CHOICES
from common.models.linear_tuning import GREEDY_CHOICES

REQUIRED = MISSING


def flag(default=REQUIRED, help: str = "", type=None, choices=None, hidden: bool = False, secret: bool = False):
    """A config field that is also a command-line flag (`secret`: left out of the config's repr)."""
    meta = {"help": argparse.SUPPRESS if hidden else help, "type": type, "choices": choices}
    if default is REQUIRED:
        return field(metadata=meta, repr=not secret)
    return field(default=default, metadata=meta, repr=not secret)


@dataclass
class ServiceConfig:
    model_path: str = flag(help="Hugging Face checkpoint folder")
    host: str = flag("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = flag(0, "port to bind (0 = any free port)")
    device: str = flag("cpu", "where the model runs", choices=["cpu", "cuda"])
    dtype: str = flag("auto", "model dtype: auto = float32 on CPU, bfloat16 on CUDA")
    max_total_tokens: int = flag(8192, "KV slots of this service's pool")
    max_running_requests: int = flag(16, "request slots (requests in flight at once)")
    context_length: int | None = flag(None, "cap on the model's context length", type=int)
    attention_backend: str = flag(
        "auto", "attention backend: auto = triton on CUDA (with CUDA graphs), batched on CPU", choices=ATTENTION_CHOICES
    )
    linear_layout: str = flag(
        "auto",
        "CPU fp32 linear layout: auto = fastest per shape and row count, timed once per host (retime: again)",
        choices=list(LAYOUT_CHOICES),
    )
    greedy_head: str = flag(
        "auto",
        "CPU fp32 greedy tokens through a bf16 lm_head pass that provably finds the fp32 argmax: "
        "auto = where timed faster",
        choices=list(GREEDY_CHOICES),
    )
    torch_threads: int = flag(0, "torch intra-op threads (0 = torch default)")
    tp_size: int = flag(1, "tensor parallel ranks on this host: rank 0 serves, the others follow (gloo on CPU)")
    tp_port: int = flag(0, "loopback port of the tensor-parallel group (0 = any free port)")
    shutdown_grace_s: float = flag(
        30.0, "on SIGTERM/SIGINT: how long open calls may finish before they are aborted (a typical answer's time)"
    )
    metrics_port: int | None = flag(
        None, "serve Prometheus metrics on this port (0 = any free port; default off)", type=int
    )
    debug_checks: bool = flag(False, "debug invariant checks: FutureMap consume-once guard, pool integrity when idle")
    speculative_algorithm: str | None = flag(
        None, "EAGLE speculative decoding (same on both services)", type=str, choices=["EAGLE", "EAGLE3"]
    )
    speculative_draft_model_path: str | None = flag(None, "draft head folder (public EAGLE / EAGLE3 layout)", type=str)
    speculative_num_steps: int = flag(3, "draft tokens proposed per step")
    speculative_eagle_topk: int = flag(1, "draft candidates per step (1: chain drafting; > 1: a tree, greedy only)")
    speculative_num_draft_tokens: int = flag(4, "tokens one verify covers (num_steps + 1 for a chain; tree nodes)")
    speculative_token_map: str | None = flag(None, "EAGLE: JSON list of hot token ids to draft from", type=str)
    disaggregation_transfer_backend: str = flag(
        "grpc",
        "how KV moves from prefill to decode: grpc (bytes on the Prefill stream), mooncake (the transfer engine "
        "writes into decode's reserved slots; gRPC carries notices) or shm (same host, CPU: decode's KV pools are "
        "files prefill maps and writes into). A prefill replica without it falls back to grpc",
        choices=["grpc", "mooncake", "shm"],
    )
    disaggregation_shm_dir: str = flag("/dev/shm", "shm backend: the shared-memory folder of decode's KV pool files")
    internal_api_key: str | None = flag(
        None,
        "key of the internal prefill API: prefill requires it, decode sends it. Prefer --internal-api-key-file "
        "or $DISAGG_INTERNAL_API_KEY: a value here shows in ps",
        type=str,
        secret=True,
    )
    internal_api_key_file: str | None = flag(
        None,
        "file holding the internal key (one line; refused if empty or other users may read it: chmod 600)",
        type=str,
    )
    tls_cert_file: str | None = flag(None, "TLS: this server's certificate (PEM); with --tls-key-file", type=str)
    tls_key_file: str | None = flag(None, "TLS: this server's private key (PEM)", type=str)
    tls_ca_file: str | None = flag(
        None, "mutual TLS: callers must present a certificate signed by this CA (PEM)", type=str
    )
    otlp_traces_endpoint: str | None = flag(
        None, "export OpenTelemetry traces over OTLP/gRPC to HOST:PORT (default: off)", type=str
    )
    disaggregation_protocol: str = flag("tcp", "mooncake transport: tcp (any host) or rdma (GPU nodes)")
    disaggregation_ib_device: str = flag("", "mooncake rdma: the InfiniBand device, e.g. mlx5_0 (empty: auto)")

    def __post_init__(self):
        api_keys.load_keys(self)  # the keys from their files or the environment (common/api_keys.py)


def build_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    for f in fields(cls):
        name = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        if f.default is MISSING:
            p.add_argument(name, required=True, type=meta["type"] or str, help=meta["help"])
        elif isinstance(f.default, bool):
            p.add_argument(name, action="store_true", help=meta["help"])
        else:
            p.add_argument(
                name,
                default=f.default,
                type=meta["type"] or type(f.default),
                choices=meta["choices"],
                help=meta["help"] if meta["help"] == argparse.SUPPRESS else f"{meta['help']} (default: %(default)s)",
            )
    return p


def parse_config(cls, prog: str, description: str, argv=None):
    """The config from the command line; with `--config FILE.yaml`, the file's values first (keys as
    the flags without the dashes, `max-total-tokens` or `max_total_tokens`) and the flags given on
    the command line over them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    p = build_parser(cls, prog, description)
    p.add_argument("--config", help="YAML file of flag values; flags on the command line override it")
    if path:
        values = _config_file(p, path)
        p.set_defaults(**values)
        for action in p._actions:
            if action.dest in values:
                action.required = False
    args = vars(p.parse_args(argv))
    args.pop("config")
    try:
        return cls(**args)
    except api_keys.KeySourceError as e:
        p.error(str(e))


def _config_file(p: argparse.ArgumentParser, path: str) -> dict:
    """{dest: value} from a YAML mapping, each value checked as its flag would be (exit 2 otherwise)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        p.error(f"--config {path}: {e}")
    if not isinstance(data, dict):
        p.error(f"--config {path}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in p._actions if a.dest not in ("help", "config")}
    values = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None:
            p.error(f"--config {path}: unknown key {key!r}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                p.error(f"--config {path}: {key} takes true or false, got {value!r}")
        elif value is not None:
            try:
                value = action.type(value) if action.type else value
            except (TypeError, ValueError):
                p.error(f"--config {path}: {key}: invalid value {value!r}")
            if action.choices and value not in action.choices:
                p.error(f"--config {path}: {key} must be one of {list(action.choices)}, got {value!r}")
        values[dest] = value
    return values
