#!/usr/bin/env bash
# Prepare what a lent GPU machine lacks (it reaches no package registry), then run the device checks there.
#   bash bench/gpu_carry.sh prepare      # here: .whl/ (grpc wheels for Python 3.12), .gpu/ (a trimmed CUDA
#                                        # Mooncake engine with the system libraries it loads, a tiny checkpoint
#                                        # and a fitted EAGLE3 head); both ignored by git, carried by the device tool
#   bash bench/gpu_carry.sh run BUDGET_S [steps]   # there, with carry [".gpu", ".whl"]
# Steps (default all, in this order): check (bench.gpu_check: GPU tests + 1B bench), tests (every GPU test alone, 4
# workers), profile (bench.gpu_profile: kernels and host ops per decode step, 8B), fused (8B and 1B, Triton +
# graphs, the fused CUDA ops on, on without the GEMV, off), triton (1B with Triton and
# CUDA graphs), spec (EAGLE3 on the tiny target), handoff (gRPC vs Mooncake into a CUDA pool), big (8B, Triton
# + graphs), big-eager (8B eager). Each step is bounded by the time left; logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
wheels() {  # NAME==VERSION... for CPython 3.12 manylinux
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$1" "${@:2}"
}
prepare() {
  for d in .whl .gpu; do grep -qx "/$d/" .git/info/exclude || echo "/$d/" >> .git/info/exclude; done
  mkdir -p .whl .gpu
  wheels .whl grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 smg-grpc-proto
  if [ ! -f .gpu/mc.tar.xz ]; then  # the CUDA engine (98 MB wheel) cut to what `mooncake.engine` loads
    t=$(mktemp -d); wheels "$t" mooncake-transfer-engine==0.3.13.post1 nvidia-cuda-runtime-cu12
    (cd "$t" && unzip -q -o 'mooncake_transfer_engine-*.whl' && unzip -q -o 'nvidia_cuda_runtime_cu12-*.whl' -d rt)
    mkdir -p "$t/pkg/site/mooncake" "$t/pkg/site/mooncake_transfer_engine.libs" "$t/pkg/syslib"
    cp "$t"/mooncake/{__init__.py,buffer_pool.py,engine.so,libasio.so,libetcd_wrapper.so} "$t/pkg/site/mooncake/"
    cp "$t"/mooncake_transfer_engine.libs/lib{gflags,glog,jsoncpp,yaml-cpp}* "$t/pkg/site/mooncake_transfer_engine.libs/"
    find "$t/rt" -name 'libcudart.so.12*' -exec cp {} "$t/pkg/syslib/" \;
    apt-get install -y -qq libibverbs1 ibverbs-providers libnuma1 libcurl4 >/dev/null 2>&1 || true
    LD_LIBRARY_PATH="$t/pkg/syslib" ldd "$t/pkg/site/mooncake/engine.so" | awk '/=> \//{print $1, $3}' |
      grep -vE '^(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so|mooncake' |
      while read -r n p; do cp -L "$p" "$t/pkg/syslib/$n"; done  # linked there only where missing
    tar -C "$t/pkg" -cJf .gpu/mc.tar.xz . && rm -rf "$t"
  fi
  [ -d .gpu/tiny ] || "$py" -c "from common.tools.tiny_checkpoint import build; build('.gpu/tiny', 'llama')"
  [ -d .gpu/tiny-head ] || "$py" -m bench.fit_eagle --target .gpu/tiny --algorithm EAGLE3 --out .gpu/tiny-head \
    --minutes 1.5 --prompts 64 --answer-tokens 48
  du -sh .whl .gpu
}
step() {  # NAME SECONDS CMD...: runs while time is left, bounded by it
  local name=$1 want=$2 left=$((BUDGET - SECONDS)); shift 2
  local t=$((want < left - 5 ? want : left - 5))
  if [ "$t" -lt 20 ]; then echo "== SKIP $name (${left}s left)"; return; fi
  echo "== $name (limit ${t}s, at ${SECONDS}s)"; timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? at ${SECONDS}s"; tail -n 40 "$OUT/$name.log"
}
run() {
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
  BUDGET=${1:-400}; shift || true; local steps=${*:-check triton spec handoff big big-eager}
  nvidia-smi -L; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  mkdir -p /tmp/mc /tmp/mclib && tar xJf .gpu/mc.tar.xz -C /tmp/mc
  for lib in $(ldd /tmp/mc/site/mooncake/engine.so | awk '/not found/{print $1}'); do
    [ -e "/tmp/mc/syslib/$lib" ] && ln -sf "/tmp/mc/syslib/$lib" "/tmp/mclib/$lib"; done
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
  lscpu | grep "Model name"
  for s in $steps; do case $s in
    check) PYTHONPATH=$PYTHONPATH:/tmp/mc/site LD_LIBRARY_PATH=/tmp/mclib PYTEST_ADDOPTS=--timeout=120 step check 260 \
      python3 -m bench.gpu_check --out-dir "$OUT/check" --shapes llama-3.2-1b;;  # the engine too: the Mooncake GPU tests
    tests) PYTHONPATH=$PYTHONPATH:/tmp/mc/site LD_LIBRARY_PATH=/tmp/mclib step tests 300 \
      python3 -m pytest tests/gpu -m gpu -q -rA -p no:cacheprovider -n 4 --timeout=150;;
    profile) step profile 300 python3 -m bench.gpu_profile --cuda-graph --out-dir "$OUT/profile" --shapes llama-3.1-8b \
      --batch-sizes 1,64 --trace-batch 1;;
    fused) step fused 300 python3 -m bench.gpu_bench --shapes llama-3.1-8b,llama-3.2-1b --attention-backend triton \
      --cuda-graph --fused on,cublas,off --no-hf;;
    triton) step triton 120 python3 -m bench.gpu_bench --shapes llama-3.2-1b --attention-backend triton --cuda-graph;;
    spec) step spec 90 python3 -m bench.spec_bench --model-path .gpu/tiny --head .gpu/tiny-head --algorithm EAGLE3 \
      --num-prompts 16 --batch-sizes 1,16 --repeats 2 --new-tokens 48 --device cuda --dtype float32 \
      --attention-backend triton --cuda-graph;;
    handoff) PYTHONPATH=$PYTHONPATH:/tmp/mc/site LD_LIBRARY_PATH=/tmp/mclib step handoff 90 python3 -m bench.handoff_bench \
      --device cuda --chunk-kib 1024,16384 --repeats 3 --pool-device cuda;;
    big) step big8b 200 python3 -m bench.gpu_bench --shapes llama-3.1-8b --attention-backend triton --cuda-graph;;
    big-eager) step big8b_eager 200 python3 -m bench.gpu_bench --shapes llama-3.1-8b;;
  esac; done
  echo "== done at ${SECONDS}s"
}
case "${1:-}" in
  prepare) prepare;;
  run) shift; run "$@";;
  *) sed -n 2,9p "$0"; exit 2;;
esac
