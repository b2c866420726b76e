# No "syntax=" line on purpose: BuildKit's built-in Dockerfile frontend (Docker Engine 20.10 and
# newer) reads this file, so a build never pulls a frontend image and works offline.
#
# Three images, all on Debian bookworm's Python 3.11 (the version the tests run), each installing exactly
# one lock with scripts/bootstrap.sh (what `make run` uses: torch first at the lock's version, --no-deps;
# then every pin --no-deps, so nothing is resolved again and nothing can pull CUDA by accident):
#
#   docker build --build-arg DEVICE=cpu -t splitserve:cpu .       requirements-run.lock: torch's CPU build
#   docker build -t splitserve:cuda .                              requirements-cuda.lock: PyPI's CUDA torch
#                                                                  (its CUDA libraries come as wheels; the
#                                                                  host gives the driver), triton, NIXL/UCX
#   docker build --target router -t splitserve:router .            requirements-router.lock: no torch
#
# Build arguments (docs/containers.md): BASE_IMAGE (debian:bookworm-slim; where no registry can be
# reached, scripts/base-image.sh makes one from Debian's packages), TORCH_INDEX (the PyTorch CPU index),
# DEFAULT_MODEL=0 (leave out the built-in SmolLM2-135M-Instruct and mount your own). A wheel put in
# ./wheels is taken before any index (torch's CPU wheel, or every pin for an offline build with
# --build-arg PIP_NO_INDEX=1). Behind a TLS-intercepting proxy give pip the proxy's CA bundle as a build
# secret, which never lands in a layer:
#   docker build --network host --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt ...
#
# Without arguments the engine image runs the whole stack in one container:
#   docker run --rm -p 8000:8000 splitserve:cpu        # = splitserve up --host 0.0.0.0
# The router asks for an API key (SPLITSERVE_ROUTER_REQUIRE_API_KEY=true below); make one with the Redis
# URL the container printed at start, its generated password included
# ("splitserve is up: ... (redis redis://:PASSWORD@127.0.0.1:PORT/0)"):
#   docker exec <container> splitserve keys create --name me --redis-url 'redis://:PASSWORD@127.0.0.1:PORT/0'
# (-e SPLITSERVE_ROUTER_REQUIRE_API_KEY=false -e SPLITSERVE_ROUTER_ALLOW_UNAUTHENTICATED=true serves
# without keys; docs/security.md).
#
# Processes run as uid/gid 10001 (numeric, so Kubernetes' runAsNonRoot can check it) and write only
# under /tmp (caches included, see the ENV below): the container runs with a read-only root filesystem
# and a writable /tmp (compose: tmpfs; the chart: an emptyDir).
ARG BASE_IMAGE=debian:bookworm-slim
ARG DEVICE=cuda

# ---- base: Python 3.11 and a venv, the non-root user, the environment every image runs with ----
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
# Packages only where the base lacks them (scripts/base-image.sh's image has them: no apt run, no network).
# /run/secrets/*: where compose mounts init-secrets' volumes; a new volume takes these folders' owner
# (10001), so init-secrets writes them without root (compose.yaml).
# /opt/splitserve/bin/splitserve (first on PATH, so also what `docker compose exec router splitserve ...`
# runs) execs the real one; with REDIS_PASSWORD_FILE set (compose.yaml) it first puts that file's
# password, and REDIS_USERNAME's user (an ACL user; none: the default user), into SPLITSERVE_REDIS_URL /
# SPLITSERVE_ROUTER_REDIS_URL when they carry no credentials.
# (SC2016: the single-quoted lines are that script's text, expanded when it runs, not now.)
# hadolint ignore=SC2016
RUN if ! dpkg -s python3 python3-venv ca-certificates >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --gid 10001 splitserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin splitserve \
    && install -d -o 10001 -g 10001 -m 0750 /run/secrets/internal /run/secrets/redis \
        /run/secrets/redis-router /run/secrets/redis-worker /run/secrets/redis-planner /run/secrets/metrics \
    && mkdir -p /opt/splitserve/bin \
    && printf '%s\n' \
        '#!/bin/sh' \
        'if [ -n "${REDIS_PASSWORD_FILE:-}" ]; then' \
        '  pw=$(cat "$REDIS_PASSWORD_FILE") || exit 1' \
        '  pw="${REDIS_USERNAME:-}:${pw}"' \
        '  case "${SPLITSERVE_REDIS_URL:-}" in *@*) ;; redis://* | rediss://*)' \
        '    export SPLITSERVE_REDIS_URL="${SPLITSERVE_REDIS_URL%%://*}://${pw}@${SPLITSERVE_REDIS_URL#*://}" ;; esac' \
        '  case "${SPLITSERVE_ROUTER_REDIS_URL:-}" in *@*) ;; redis://* | rediss://*)' \
        '    export SPLITSERVE_ROUTER_REDIS_URL="${SPLITSERVE_ROUTER_REDIS_URL%%://*}://${pw}@${SPLITSERVE_ROUTER_REDIS_URL#*://}" ;; esac' \
        'fi' \
        'exec /opt/venv/bin/splitserve "$@"' \
        > /opt/splitserve/bin/splitserve \
    && chmod 0755 /opt/splitserve/bin/splitserve
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

# ---- GPU additions: a C compiler with Python headers (Triton builds its small launcher module on first
# use) and rdma-core's user-space libraries for UCX's InfiniBand/RoCE transports ----
FROM base AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        gcc libc6-dev python3-dev ibverbs-providers libibverbs1 librdmacm1 \
    && rm -rf /var/lib/apt/lists/*

FROM base AS base-cpu

# ---- the sources (one list for both images) ----
FROM scratch AS src
COPY pyproject.toml README.md /app/
COPY splitserve /app/splitserve
COPY common /app/common
COPY router /app/router
COPY prefill_service /app/prefill_service
COPY decode_service /app/decode_service
COPY kv_transfer /app/kv_transfer
COPY bench /app/bench
COPY planner /app/planner

# ---- the router: no torch, no engine (requirements-router.lock) ----
FROM base AS router
ARG DEFAULT_MODEL=1
ARG PIP_INDEX_URL
ARG PIP_NO_INDEX
COPY scripts/bootstrap.sh /app/scripts/
COPY requirements-router.lock /app/
# the dependencies first (a layer source changes do not rebuild), then the package
RUN --mount=type=bind,source=wheels,target=/wheels \
    --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && PIP_FIND_LINKS=/wheels PIP_NO_CACHE_DIR=1 ONLY=deps WITHOUT_TORCH=1 MODEL="${DEFAULT_MODEL}" \
        bash scripts/bootstrap.sh /opt/venv requirements-router.lock
COPY --from=src /app /app
RUN PIP_NO_CACHE_DIR=1 ONLY=project WITHOUT_TORCH=1 EDITABLE=0 \
        bash scripts/bootstrap.sh /opt/venv requirements-router.lock \
    && rm -rf build ./*.egg-info
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["splitserve"]
CMD ["router"]

# ---- the engine image (every role: `splitserve router|prefill|decode|up`) on whichever base DEVICE
# names: DEVICE=cpu installs requirements-run.lock, DEVICE=cuda requirements-cuda.lock ----
# hadolint ignore=DL3006
FROM base-${DEVICE} AS engine
ARG DEVICE
ARG DEFAULT_MODEL=1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL
ARG PIP_NO_INDEX
COPY scripts/bootstrap.sh /app/scripts/
COPY requirements-run.lock requirements-cuda.lock /app/
RUN --mount=type=bind,source=wheels,target=/wheels \
    --mount=type=secret,id=ca_bundle \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && lock=requirements-run.lock && if [ "${DEVICE}" = cuda ]; then lock=requirements-cuda.lock; fi \
    && PIP_FIND_LINKS=/wheels PIP_NO_CACHE_DIR=1 ONLY=deps MODEL="${DEFAULT_MODEL}" TORCH_WHEELS=/wheels \
        TORCH_INDEX="${TORCH_INDEX}" bash scripts/bootstrap.sh /opt/venv "$lock"
COPY --from=src /app /app
RUN lock=requirements-run.lock && if [ "${DEVICE}" = cuda ]; then lock=requirements-cuda.lock; fi \
    && PIP_NO_CACHE_DIR=1 ONLY=project EDITABLE=0 bash scripts/bootstrap.sh /opt/venv "$lock" \
    && rm -rf build ./*.egg-info
USER 10001:10001
# router, prefill, decode, decode's KV receiver (SPLITSERVE_KV_PORT; compose and the chart pin it)
EXPOSE 8000 8101 8201 8202
ENTRYPOINT ["splitserve"]
CMD ["up", "--host", "0.0.0.0"]
