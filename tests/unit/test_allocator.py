"""common/runtime/allocator.py in fresh processes: with the tuning, the large blocks a step frees are
reused by the next steps, so once the heap has settled a step faults no page in; with
SPLITSERVE_MALLOC=system, or when GLIBC_TUNABLES already chose, glibc's defaults stay."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

# A "step" in a thread (as the engine thread runs them): two large activations and a result, all freed.
# Repeated: once the heap has settled (glibc places chunks best-fit around the small blocks that land
# between them: after 3 to 10 steps in 16 runs here, the heap then holding 2.5 to 6.5 times the step's
# 128 MiB) a step finds its memory already mapped and faults no page in.
CHILD = """
import json, resource, threading
from common.runtime.allocator import tune
import torch
said = tune()
out = {"said": said, "faults": []}
def step():
    a = torch.ones(16 * 2**20); b = torch.ones(8 * 2**20); c = a[: 8 * 2**20] + b  # 64 + 32 + 32 MiB
    del a, b, c
def run():
    for _ in range(40):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        out["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=run); t.start(); t.join()
print(json.dumps(out))
"""


def child(**env: str) -> dict[str, object]:
    full = {k: v for k, v in os.environ.items() if k not in ("SPLITSERVE_MALLOC", "GLIBC_TUNABLES")}
    r = subprocess.run(
        [sys.executable, "-c", CHILD], env={**full, **env}, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_freed_large_block_is_reused_without_faulting_its_pages_in_again() -> None:
    tuned = child()
    assert tuned["said"].startswith("glibc malloc keeps freed memory"), tuned
    assert max(tuned["faults"][-3:]) < 100, tuned  # a step touches 128 MiB: 32,768 pages of 4 KiB
    system = child(SPLITSERVE_MALLOC="system")
    assert "defaults" in system["said"], system
    assert min(system["faults"][-3:]) > 10_000, system  # glibc mmaps them afresh every step


def test_a_choice_made_elsewhere_is_left_alone() -> None:
    got = child(GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert "untouched" in got["said"], got
    assert min(got["faults"][-3:]) > 10_000, got  # glibc's own thresholds: every step faults again


def test_the_command_refuses_an_unknown_setting_with_a_clear_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_MALLOC"}
    r = subprocess.run(  # tune() raises a ValueError naming it; the command prints it and exits 2
        [sys.executable, "-m", "splitserve", "--help"],
        env={**env, "SPLITSERVE_MALLOC": "tcmalloc"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: SPLITSERVE_MALLOC='tcmalloc'"), r.stderr
    assert "Traceback" not in r.stderr
