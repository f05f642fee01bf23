# One image for the three compose services (prefill, decode, smg gateway) on NVIDIA GPU nodes.
# torch from PyPI brings its own CUDA libraries; the NVIDIA container runtime provides the driver.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY proto ./proto
# libibverbs1 and the CUDA build of the Mooncake transfer engine: --disaggregation-transfer-backend mooncake
# (RDMA with --disaggregation-protocol rdma --disaggregation-ib-device mlx5_0 where the node has InfiniBand)
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 && rm -rf /var/lib/apt/lists/*
RUN pip install . "smg>=1.13" "mooncake-transfer-engine==0.3.13.post1"

# The services run as an unprivileged user (uid 1000, numeric so Kubernetes' runAsNonRoot can check it).
# Its home holds what they write at run time: the linear-layout table and its lock (~/.cache/disagg-serve),
# Triton's and TorchInductor's compiled kernels; /tmp is the other scratch place (an emptyDir each on
# Kubernetes, where the root filesystem is read-only).
RUN groupadd --gid 1000 disagg && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/disagg \
    --shell /usr/sbin/nologin disagg \
    && mkdir -p /var/lib/disagg-keys && chown 1000:1000 /var/lib/disagg-keys && chmod 0700 /var/lib/disagg-keys
# (compose's `keys` volume takes that folder's owner and mode when first mounted: common/tools/keygen.py)
ENV HOME=/home/disagg XDG_CACHE_HOME=/home/disagg/.cache TRITON_CACHE_DIR=/home/disagg/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/disagg/.cache/torchinductor PYTHONDONTWRITEBYTECODE=1
USER 1000:1000

# Models are mounted at /models (see compose.yaml); nothing is downloaded at run time.
CMD ["python", "-m", "decode_service", "--help"]
