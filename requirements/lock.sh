#!/usr/bin/env bash
# Refreshes the lock files from pyproject.toml and requirements/*.in with uv (`uv pip compile`):
#   requirements/cpu.txt      the CPU image: the runtime dependencies, torch's CPU build, the CPU Mooncake
#                             engine and the smg gateway
#   requirements/cpu-dev.txt  .ci/setup and CI: all of cpu.txt (as constraints) plus the dev and demo extras
#   requirements/cuda.txt     the GPU image: the same with torch's CUDA build and the CUDA Mooncake engine,
#                             resolved for linux x86_64 without installing anything
# Every file pins every package with its hashes, for CPython 3.11 on manylinux_2_28 x86_64 (the image's
# base and the CI machines). Where packages come from is read from this host's pip settings at run time
# (index-url, extra-index-url, find-links, cert): nothing about a registry or mirror is written here.
#   bash requirements/lock.sh            # all three;  UV=/path/to/uv to use an installed uv
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${UV:-}
if [ -z "$uv" ]; then
  uv=$(command -v uv || true)
fi
if [ -z "$uv" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "[lock] installing uv into a temporary venv" >&2
  python3 -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q uv 2>&1 | { grep -v '^WARNING: Location' || true; }
  uv="$tmp/venv/bin/uv"
fi
pipcfg() { python3 -m pip config get "global.$1" 2>/dev/null || true; }
args=(--quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
      --index-strategy unsafe-best-match --custom-compile-command "bash requirements/lock.sh")
index=$(pipcfg index-url)
[ -n "$index" ] && args+=(--index-url "$index")
for url in $(pipcfg extra-index-url); do args+=(--extra-index-url "$url"); done
# find-links (the host's local wheels, where its CPU torch build lies) serve the CPU locks only: torch==2.13.0
# would match a local +cpu build there, and the CUDA lock wants the index's CUDA build.
cpu_args=()
for dir in $(pipcfg find-links); do cpu_args+=(--find-links "$dir"); done
cert=$(pipcfg cert)
[ -n "$cert" ] && export SSL_CERT_FILE="$cert"
echo "[lock] requirements/cpu.txt" >&2
# triton is left out of the CPU image's lock: only xgrammar asks for it (for its CUDA kernels; on CPU it
# masks in C++), and it would add ~1 GB; the image installs the lock --no-deps. CI's lock keeps it (the tests
# run Triton's interpreter).
"$uv" pip compile "${args[@]}" "${cpu_args[@]}" --no-emit-package triton pyproject.toml requirements/cpu.in \
  -o requirements/cpu.txt
echo "[lock] requirements/cpu-dev.txt" >&2
"$uv" pip compile "${args[@]}" "${cpu_args[@]}" pyproject.toml requirements/cpu.in --extra dev --extra demo \
  -c requirements/cpu.txt -o requirements/cpu-dev.txt
echo "[lock] requirements/cuda.txt" >&2
"$uv" pip compile "${args[@]}" pyproject.toml requirements/cuda.in -o requirements/cuda.txt
grep -q "^torch==2.13.0+cpu " requirements/cpu.txt && ! grep -q "^torch==.*+cpu" requirements/cuda.txt
grep -c '==' requirements/cpu.txt requirements/cpu-dev.txt requirements/cuda.txt >&2
