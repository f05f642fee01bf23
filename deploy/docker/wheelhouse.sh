#!/usr/bin/env bash
# Makes the wheelhouse the image installs from, on the host, from the lock: .wheelhouse/VARIANT/ holds
# every wheel of requirements/VARIANT.txt (hash-checked; for CPython 3.11 on manylinux x86_64, whatever
# this host runs), .wheelhouse/VARIANT-app/ the project's own wheel. The image build then reaches no package index, so it
# builds on air-gapped clusters: carry the folder there, or make it on any host that reaches one.
#   bash deploy/docker/wheelhouse.sh cpu     # the CPU image (torch's CPU build: the host's pip must find it)
#   bash deploy/docker/wheelhouse.sh cuda    # the GPU image (torch's CUDA build and the CUDA libraries, ~3 GB)
# Where packages come from is this host's pip settings; for cuda its find-links folders are left out (a
# local CPU torch build there would shadow the index's CUDA build of the same version).
set -euo pipefail
cd "$(dirname "$0")/../.."
variant=${1:?usage: wheelhouse.sh cpu|cuda}
lock=requirements/$variant.txt
[ -f "$lock" ] || { echo "no lock $lock" >&2; exit 2; }
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=${PYTHON:-.venv/bin/python}
out=.wheelhouse/$variant
mkdir -p "$out"
opts=(--disable-pip-version-check --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform linux_x86_64 --platform any)
if [ "$variant" = cuda ]; then
  pipcfg() { "$py" -m pip config get "global.$1" 2>/dev/null || true; }
  iso=(--isolated)
  index=$(pipcfg index-url); [ -n "$index" ] && iso+=(--index-url "$index")
  for url in $(pipcfg extra-index-url); do iso+=(--extra-index-url "$url"); done
  cert=$(pipcfg cert); [ -n "$cert" ] && iso+=(--cert "$cert")
  opts=("${iso[@]}" "${opts[@]}")
fi
echo "[wheelhouse] $lock -> $out" >&2
"$py" -m pip download -q "${opts[@]}" --require-hashes --no-deps -r "$lock" -d "$out"
echo "[wheelhouse] the project's wheel -> $out-app" >&2
rm -rf "$out-app" && mkdir -p "$out-app"
had_build=0; [ -e build ] && had_build=1
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out-app" .
[ "$had_build" = 1 ] || rm -rf build  # setuptools' scratch folder, unless it was there before
du -sh "$out" "$out-app" >&2
