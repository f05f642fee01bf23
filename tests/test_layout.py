"""The layout holds: the engine runs without the wire or the tools (or gRPC), files stay small, and
docs/architecture.md's layout table names exactly the modules in the tree."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_DIRS = ["common/models", "common/attention", "common/engine"]
ENGINE_FILES = [
    "common/request_rules.py",
    "decode_service/scheduler.py",
    "decode_service/future_map.py",
    "decode_service/schedule_batch.py",
    "decode_service/req.py",
    "decode_service/output.py",
    "decode_service/scheduler_types.py",
    "decode_service/inbox.py",
    "decode_service/decode_step.py",
    "decode_service/eagle_step.py",
    "decode_service/handoff_writes.py",
    "decode_service/eagle_tree_step.py",
    "decode_service/worker.py",
    "decode_service/worker_batch.py",
    "decode_service/tp_messages.py",
    "prefill_service/worker.py",
    "prefill_service/inprocess.py",
    "prefill_service/draft_prefill.py",
    "prefill_service/scheduler.py",
    "prefill_service/hooks.py",
    "prefill_service/tp_messages.py",
]
FORBIDDEN = (
    "common.wire",
    "common.tools",
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "google.protobuf",
    "smg_grpc_proto",
)


def _py_files(*dirs: str) -> list[str]:
    out = []
    for d in dirs:
        for dirpath, _, names in os.walk(os.path.join(ROOT, d)):
            out += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(out)


def _engine_files() -> list[str]:
    return _py_files(*ENGINE_DIRS) + ENGINE_FILES


def _imports(path: str) -> list[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = []
    for node in ast.walk(tree):  # function-local imports count too
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_engine_imports_nothing_from_the_wire_tools_or_grpc():
    bad = {f: [n for n in _imports(f) if n.startswith(FORBIDDEN)] for f in _engine_files()}
    assert not {f: n for f, n in bad.items() if n}


def test_engine_modules_import_with_grpc_and_protobuf_absent():
    modules = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in _engine_files()]
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted({m.split('.')[0] for m in FORBIDDEN[2:]})!r}:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {modules!r}:\n"
        "    __import__(m)\n"
        "print('ok', len(sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", blocker], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-2000:]


def test_no_file_over_500_lines():
    """Files are split by job, never by size alone; one job past ~500 lines is where to look for a second."""
    files = [
        f
        for f in _py_files("common", "decode_service", "prefill_service", "tests", "bench", "proto")
        if "proto_gen" not in f
    ]
    long = {f: n for f in files if (n := sum(1 for _ in open(os.path.join(ROOT, f)))) > 500}
    assert not long


def test_architecture_layout_table_matches_the_tree():
    """docs/architecture.md's layout table (what every module holds) names exactly the modules in the tree."""
    doc = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    section = doc[doc.index("## Layout") :]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    named = set(re.findall(r"`((?:common|decode_service|prefill_service)/[\w/]+\.py)`", section))
    modules = {
        f
        for f in _py_files("common", "decode_service", "prefill_service")
        if not f.endswith("__init__.py") and "proto_gen" not in f
    }
    assert named <= modules, f"docs/architecture.md's layout names files that do not exist: {sorted(named - modules)}"
    assert modules <= named, f"docs/architecture.md's layout table misses: {sorted(modules - named)}"


def test_common_imports_no_service():
    bad = {
        f: [n for n in _imports(f) if n.split(".")[0] in ("decode_service", "prefill_service", "bench", "tests")]
        for f in _py_files("common")
    }
    assert not {f: n for f, n in bad.items() if n}


def test_the_decode_scheduler_imports_nothing_that_runs_a_model():
    """The scheduler runs with a fake worker: importing it loads no model code, attention or worker."""
    model_code = [
        "common.models",
        "common.attention",
        "common.engine.model_runner",
        "common.engine.draft_runner",
        "common.forward.forward_batch",
        "decode_service.worker",
        "decode_service.decode_step",
        "decode_service.eagle_step",
        "decode_service.eagle_tree_step",
        "decode_service.future_map",
        "transformers",
    ]
    probe = (
        "import sys\n"
        "import decode_service.scheduler\n"
        f"names = {model_code!r}\n"
        "print(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in names)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"the scheduler pulls in model code: {proc.stdout}"


def test_no_file_cites_a_document_outside_the_repository():
    """What the code relies on is written in docs/ (a newcomer can read it there): no tracked file
    points at a design document kept beside the repository."""
    outside = re.compile("|".join([r"\.\./" + "shared", "DESIGN" + r"(\.md| section| ?§| \d)"]))
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    cited = []
    for name in files:
        try:
            with open(os.path.join(ROOT, name), encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        cited += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in outside.finditer(text)]
    assert not cited, cited


def _package_imports() -> dict[str, set[str]]:
    """common's packages (and top-level modules) -> the others each imports at module level (imports
    under `if TYPE_CHECKING:` are annotations, not edges)."""
    files = [f for f in _py_files("common") if "proto_gen" not in f]
    unit = {f: ".".join(f.removesuffix("/__init__.py").removesuffix(".py").split("/")[:2]) for f in files}
    known, edges = set(unit.values()), {}
    for f in files:
        for node in ast.parse(open(os.path.join(ROOT, f)).read()).body:
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for there in {".".join(n.split(".")[:2]) for n in names} & known - {unit[f]}:
                edges.setdefault(unit[f], set()).add(there)
    return edges


def test_the_packages_of_common_import_each_other_without_a_cycle():
    """Shared types sit below the code that uses them (a forward's batch and copies in common/forward,
    below attention, models and the engine), so no package of common/ reaches itself through another."""
    edges = _package_imports()

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = sorted(f"{a} -> {b}" for a, deps in edges.items() for b in deps if reaches(b, a, set()))
    assert edges and not cycles, cycles
