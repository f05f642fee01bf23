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

# Models are mounted at /models (see compose.yaml); nothing is downloaded at run time.
CMD ["python", "-m", "decode_service", "--help"]
