"""Service configuration, declared once: each field of a config dataclass is one CLI flag.

`flag(default, help)` declares a field with its help text. Fields come in small groups, one per
concern (`ModelFlags`, `SecurityFlags`, ...): each a keyword-only dataclass deriving from
`FlagGroup` with a `title`, its docstring saying what the group is for. A service's config
inherits the groups it takes, so its fields stay flat (`config.port`, `DecodeConfig(path, port=0)`;
only `model_path` may be given by position) and may override a group's default in its own body.

`build_parser(cls)` turns a config into an argparse parser with one section per group
(`model_path` -> `--model-path`; bools are switches; a field without a default is required), and
`parse_config(cls, argv)` returns the config. `ServiceConfig` holds the groups both services share
(same names, same meaning). `flag_sections(cls)` is what the parser and docs/flags.md
(`python -m common.tools.flags_doc`) are both made from.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, Field, dataclass, field, fields

from common import api_keys
from common.attention import CHOICES as ATTENTION_CHOICES
from common.engine.kv_pool import KV_CACHE_DTYPES
from common.models.linear_tuning import CHOICES as LAYOUT_CHOICES
from common.models.linear_tuning import GREEDY_CHOICES

REQUIRED = MISSING


def flag(
    default=REQUIRED,
    help: str = "",
    type=None,
    choices=None,
    hidden: bool = False,
    secret: bool = False,
    positional: bool = False,
):
    """A config field that is also a command-line flag (`secret`: left out of the config's repr;
    `positional`: the constructor also takes it by position, as the first argument)."""
    meta = {"help": argparse.SUPPRESS if hidden else help, "type": type, "choices": choices}
    kw_only = False if positional else MISSING  # MISSING: as the class says (groups are keyword-only)
    if default is REQUIRED:
        return field(metadata=meta, repr=not secret, kw_only=kw_only)
    return field(default=default, metadata=meta, repr=not secret, kw_only=kw_only)


class FlagGroup:
    """Base of the flag groups: `class XFlags(FlagGroup, title="x")` makes the flags the class
    declares one section of `--help` and of docs/flags.md, described by the class's docstring."""

    def __init_subclass__(cls, title: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if title is not None:
            cls._flag_section = (title, inspect.cleandoc(cls.__doc__ or ""))


def flag_sections(cls) -> list[tuple[str, str, list[Field]]]:
    """[(title, description, fields)] of a config class: one per group, in the order its bases
    list them, each field in the group that first declared it (overrides in a subclass stay there)."""
    order = {klass: i for i, klass in enumerate(cls.__mro__)}
    sections: dict[type, list[Field]] = {}
    for f in fields(cls):
        owner = next(k for k in reversed(cls.__mro__) if f.name in getattr(k, "__dataclass_fields__", {}))
        if "_flag_section" not in vars(owner):
            raise TypeError(f"{cls.__name__}.{f.name}: declared in {owner.__name__}, which is no titled FlagGroup")
        sections.setdefault(owner, []).append(f)
    titles = [vars(owner)["_flag_section"][0] for owner in sections]
    if len(set(titles)) != len(titles):
        raise TypeError(f"{cls.__name__}: two flag groups share a title: {sorted(titles)}")
    return [(*vars(owner)["_flag_section"], fs) for owner, fs in sorted(sections.items(), key=lambda s: order[s[0]])]


@dataclass(kw_only=True)
class ModelFlags(FlagGroup, title="model"):
    """The checkpoint and how this host runs it."""

    model_path: str = flag(help="Hugging Face checkpoint folder", positional=True)
    device: str = flag("cpu", "where the model runs", choices=["cpu", "cuda"])
    dtype: str = flag("auto", "model dtype: auto = float32 on CPU, bfloat16 on CUDA")
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
    quantization: str = flag(
        "none",
        "CPU fp32: w8 = weight-only int8 linears (a float32 scale per output row, activations float32): "
        "a quarter of the bytes a decode step reads; bf16 = weight-only bf16 linears (rounded to nearest, "
        "activations float32): half of them; bf16-matmul = bf16 linears whose inputs are rounded to bf16 too "
        "(products bf16 x bf16, sums float32; the rest and KV float32): AVX512-BF16's dot product, half "
        "the time of a many-row GEMM (large decode batches, prefill); w8a8 = int8 weights with a bf16 scale per row "
        "and block of 32 k (as llama.cpp's Q8_0), each linear's input quantized to int8 per block of 16 (integer "
        "products summed exactly): AVX512-VNNI's dot product, "
        "int8's bytes at one row and a quarter of fp32's instructions at many; none is token-exact with fp32",
        choices=["none", "w8", "bf16", "bf16-matmul", "w8a8"],
    )
    kv_cache_dtype: str = flag(
        "auto",
        "KV cache dtype: bfloat16 = CPU float32 models keep K and V rounded to bf16 (half the bytes a decode step's "
        "attention reads and twice the slots per byte; attention still sums in float32; not token-exact with "
        "float32); float32 = a float32 model's KV in float32; auto = the model's, except bfloat16 for a CPU "
        "float32 model with a --quantization other than none (its answers measured as close to float32's, its "
        "steps shorter). Give both services the same value and --quantization: the shm and Mooncake handoffs "
        "write prefill's bytes into decode's pool as they are (and refuse a slot of another size)",
        choices=list(KV_CACHE_DTYPES),
    )
    torch_threads: int = flag(0, "torch intra-op threads (0 = torch default)")
    disable_cpu_fused: bool = flag(
        False,
        "CPU fp32: run RMSNorm, SiLU-and-mul, decode attention, the few-row GEMV and the dense decode step "
        "through torch ops instead of the fused C++ ops (built once per host on first use; without a "
        "compiler the torch ops run anyway)",
    )
    disable_cuda_fused: bool = flag(
        False,
        "CUDA: run RMSNorm (and the residual add before it), SiLU-and-mul, rotary + the KV write and the "
        "few-row linears through torch ops and cuBLAS instead of the fused Triton kernels and the GEMV (each "
        "linear shape's GEMV-or-cuBLAS choice is timed at warm-up)",
    )
    constrained_json_disable_any_whitespace: bool = flag(
        False,
        "json_schema constraints (and smg's json_object) compile without free whitespace between JSON tokens "
        "(SGLang's flag; give both services the same value: prefill masks the first token, decode the rest)",
    )


@dataclass(kw_only=True)
class ServerFlags(FlagGroup, title="server"):
    """Where the service listens and how it stops."""

    host: str = flag("127.0.0.1", "address to bind (loopback unless told otherwise)")
    port: int = flag(0, "port to bind (0 = any free port)")
    shutdown_grace_s: float = flag(
        30.0, "on SIGTERM/SIGINT: how long open calls may finish before they are aborted (a typical answer's time)"
    )


@dataclass(kw_only=True)
class CapacityFlags(FlagGroup, title="capacity"):
    """The KV pool and the request slots."""

    max_total_tokens: int = flag(8192, "KV slots of this service's pool")
    max_running_requests: int = flag(16, "request slots (requests in flight at once)")


@dataclass(kw_only=True)
class ParallelFlags(FlagGroup, title="parallel"):
    """Tensor (and expert) parallelism, on this host or across several (--nnodes)."""

    tp_size: int = flag(1, "tensor parallel ranks (on all nodes together): rank 0 serves, the others follow")
    tp_port: int = flag(0, "loopback port of the tensor-parallel group (0 = any free port; --nnodes 1 only)")
    nnodes: int = flag(1, "hosts the TP group spans: each runs --tp-size / --nnodes ranks (same flags on every node)")
    node_rank: int = flag(0, "this host's place in the group: 0 runs the service, others only follower ranks")
    dist_init_addr: str | None = flag(
        None,
        "HOST:PORT where rank 0's group store listens (bound to exactly HOST); the other nodes connect to it. "
        "Required with --nnodes > 1",
        type=str,
    )
    tp_key_file: str | None = flag(
        None,
        "file holding the TP group's key (every node the same file; chmod 600): required with --nnodes > 1; "
        "without it each launch makes its own key",
        type=str,
    )
    ep_size: int = flag(
        1,
        "expert parallelism of mixture-of-experts layers under --tp-size: 1 = every rank holds a slice of "
        "every expert, --tp-size = each rank holds num_experts / tp-size experts whole",
    )


@dataclass(kw_only=True)
class SpeculativeFlags(FlagGroup, title="speculative"):
    """EAGLE / EAGLE3 speculative decoding (NEXTN: DeepSeek's MTP layer); both services take the same values."""

    speculative_algorithm: str | None = flag(
        None,
        "EAGLE speculative decoding (same on both services); NEXTN is an alias of EAGLE for DeepSeek's MTP layer",
        type=str,
        choices=["EAGLE", "EAGLE3", "NEXTN"],
    )
    speculative_draft_model_path: str | None = flag(
        None,
        "draft head folder (public EAGLE / EAGLE3 layout, or a DeepSeek-V3 checkpoint / exported NextN folder; "
        "NEXTN without it: the target's own MTP layer)",
        type=str,
    )
    speculative_num_steps: int = flag(3, "draft tokens proposed per step")
    speculative_eagle_topk: int = flag(1, "draft candidates per step (1: chain drafting; > 1: a tree, greedy only)")
    speculative_num_draft_tokens: int = flag(4, "tokens one verify covers (num_steps + 1 for a chain; tree nodes)")
    speculative_token_map: str | None = flag(None, "EAGLE: JSON list of hot token ids to draft from", type=str)


@dataclass(kw_only=True)
class TransferFlags(FlagGroup, title="transfer"):
    """How the KV cache moves from prefill to decode; both services take the same backend."""

    disaggregation_transfer_backend: str = flag(
        "grpc",
        "how KV moves from prefill to decode: grpc (bytes on the Prefill stream), mooncake (the transfer engine "
        "writes into decode's reserved slots; gRPC carries notices) or shm (same host, CPU: decode's KV pools are "
        "files prefill maps and writes into). A prefill replica without it falls back to grpc",
        choices=["grpc", "mooncake", "shm"],
    )
    disaggregation_shm_dir: str = flag("/dev/shm", "shm backend: the shared-memory folder of decode's KV pool files")
    disaggregation_protocol: str = flag("tcp", "mooncake transport: tcp (any host) or rdma (GPU nodes)")
    disaggregation_ib_device: str = flag("", "mooncake rdma: the InfiniBand device, e.g. mlx5_0 (empty: auto)")
    disaggregation_network_private: bool = flag(
        False,
        "mooncake: the operator's word that only the two services can reach each other's transfer engine "
        "(the engine binds every interface whatever --host says and serves its registered KV memory to any "
        "peer that reaches it): mooncake is refused without it",
    )


@dataclass(kw_only=True)
class SecurityFlags(FlagGroup, title="security"):
    """The internal key between the services, and TLS."""

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


@dataclass(kw_only=True)
class ObservabilityFlags(FlagGroup, title="observability"):
    """Metrics, traces and debug checks."""

    metrics_port: int | None = flag(
        None, "serve Prometheus metrics on this port (0 = any free port; default off)", type=int
    )
    otlp_traces_endpoint: str | None = flag(
        None, "export OpenTelemetry traces over OTLP/gRPC to HOST:PORT (default: off)", type=str
    )
    debug_checks: bool = flag(False, "debug invariant checks: FutureMap consume-once guard, pool integrity when idle")


@dataclass(kw_only=True)
class ServiceConfig(
    ModelFlags,
    ServerFlags,
    CapacityFlags,
    ParallelFlags,
    SpeculativeFlags,
    TransferFlags,
    SecurityFlags,
    ObservabilityFlags,
):
    """The groups both services take; each service adds its own and may override a default."""

    def __post_init__(self):
        api_keys.load_keys(self)  # the keys from their files or the environment (common/api_keys.py)


def build_parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    for title, about, group_fields in flag_sections(cls):
        section = p.add_argument_group(title, about)
        for f in group_fields:
            _add_flag(section, f)
    return p


def _add_flag(section, f: Field) -> None:
    name = "--" + f.name.replace("_", "-")
    meta = dict(f.metadata)
    if f.default is MISSING:
        section.add_argument(name, required=True, type=meta["type"] or str, help=meta["help"])
    elif isinstance(f.default, bool) and f.default:  # on by default: --no-NAME turns it off
        section.add_argument(name, action=argparse.BooleanOptionalAction, default=True, help=meta["help"])
    elif isinstance(f.default, bool):
        section.add_argument(name, action="store_true", help=meta["help"])
    else:
        section.add_argument(
            name,
            default=f.default,
            type=meta["type"] or type(f.default),
            choices=meta["choices"],
            help=meta["help"] if meta["help"] == argparse.SUPPRESS else f"{meta['help']} (default: %(default)s)",
        )


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
