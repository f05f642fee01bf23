# One image for the compose services (prefill, decode, smg gateway; the keygen one-shot), built from a
# wheelhouse the host makes from the lock, so the build reaches no package index:
#   bash deploy/docker/wheelhouse.sh cuda && docker build -t disagg-serve:latest .                    # GPU nodes
#   bash deploy/docker/wheelhouse.sh cpu && docker build --build-arg VARIANT=cpu -t disagg-serve:cpu .  # CPU
# VARIANT picks the lock (requirements/VARIANT.txt: every package pinned with its hashes) and the wheelhouse
# (.wheelhouse/VARIANT/; the project's own wheel in .wheelhouse/VARIANT-app/, installed last, so a code
# change rebuilds only that layer). BASE_IMAGE is any Debian-like image with python3.11, its venv module, and
# libibverbs1 or apt-get (the Mooncake engine loads libibverbs.so.1 even for TCP); where Docker Hub cannot
# be reached, `python -m bench.docker_engine base` makes one from Debian packages. torch's CUDA build
# brings its own CUDA libraries; the NVIDIA container runtime provides the driver.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG VARIANT=cuda
COPY requirements/${VARIANT}.txt /tmp/lock.txt
COPY .wheelhouse/${VARIANT} /tmp/wheels
RUN python -m venv /opt/venv \
    && /opt/venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-index \
       --find-links /tmp/wheels --require-hashes --no-deps -r /tmp/lock.txt

FROM ${BASE_IMAGE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# libibverbs1 for --disaggregation-transfer-backend mooncake (RDMA with --disaggregation-protocol rdma
# --disaggregation-ib-device mlx5_0 where the node has InfiniBand): from the base, else from apt.
RUN if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then \
      apt-get update && apt-get install -y --no-install-recommends libibverbs1 && rm -rf /var/lib/apt/lists/*; \
    fi
# The CPU image carries a C++ compiler and ninja: the fused CPU ops (common/kernels/) are compiled on
# first start for the host's own CPU (-march=native), ~20 s; without them the torch ops serve, ~1.8x
# slower at batch 1 (BENCHMARKS.md). The CUDA image leaves them out (CPU fp32 only).
ARG VARIANT=cuda
RUN if [ "$VARIANT" = cpu ]; then \
      apt-get update && apt-get install -y --no-install-recommends g++ ninja-build && rm -rf /var/lib/apt/lists/*; \
    fi
# The services run as an unprivileged user (uid 1000, numeric so Kubernetes' runAsNonRoot can check it).
# Its home holds what they write at run time: the linear-layout table and its lock (~/.cache/disagg-serve),
# Triton's and TorchInductor's compiled kernels; /tmp is the other scratch place (an emptyDir each on
# Kubernetes, where the root filesystem is read-only).
RUN groupadd --gid 1000 disagg && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/disagg \
    --shell /usr/sbin/nologin disagg \
    && mkdir -p /home/disagg/.cache && chown 1000:1000 /home/disagg/.cache \
    && mkdir -p /var/lib/disagg-keys && chown 1000:1000 /var/lib/disagg-keys && chmod 0700 /var/lib/disagg-keys
# (compose's `keys` volume takes that folder's owner and mode when first mounted: common/tools/keygen.py)
COPY --from=build /opt/venv /opt/venv
ARG VARIANT=cuda
COPY .wheelhouse/${VARIANT}-app /tmp/app
RUN python -m pip install -q --disable-pip-version-check --no-cache-dir --no-index \
       --find-links /tmp/app --no-deps disagg-serve \
    && rm -rf /tmp/app
ENV HOME=/home/disagg XDG_CACHE_HOME=/home/disagg/.cache TRITON_CACHE_DIR=/home/disagg/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/disagg/.cache/torchinductor PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/disagg
USER 1000:1000

# Models are mounted at /models (see compose.yaml); nothing is downloaded at run time.
CMD ["python", "-m", "decode_service", "--help"]
