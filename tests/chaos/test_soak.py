"""A short soak (`splitserve bench soak`) in every `make test`: 120 requests at concurrency 6 through
two prefill and two decode services, a tenth of the clients hanging up early, a decode service and a
prefill service each killed (SIGKILL) and restarted on their ports during the run, every service with
a RAM and a disk KV offload tier behind a pool small enough to evict, half the prompts asked again
(`--tiers`). Nothing is lost, nothing fails, nothing leaks; the tiers are written and read back, no read
fails to verify, and they stay within their limits. The default size (5,000 requests) is the recorded
figure (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.services, pytest.mark.chaos]


@pytest.mark.timeout(600)
def test_a_short_soak_with_faults_loses_and_leaks_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "splitserve", "bench", "soak", "--requests", "120", "--concurrency", "6",
           "--tiers", "--json", "--out", str(tmp_path)]  # fmt: skip
    # its services' logs (a temp folder it keeps for the reader) go under this test's tmp_path
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=560, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert (r["lost"], r["failed"], r["leaked_blocks"], r["leaked_leases"]) == (0, 0, 0, 0), (r["errors"], r)
    assert r["completed"] + r["cancelled"] == r["requests"] == 120 and r["cancelled"] > 0, r
    assert [f["role"] for f in r["faults"]] == ["decode", "prefill"]
    for name in ("prefill-1", "decode-1"):  # the services never restarted: no runaway memory
        assert r["rss_mb_end"][name] <= 1.25 * r["rss_mb_start"][name], r
    t = r["tiers"]
    assert t["verify_failures"] == 0 and t["writes"] > 0 and t["hits"] > 0, t
    for key in ("ram_bytes", "disk_bytes"):
        assert t["end"][key] <= t["limit"][key], t
    assert t["end"]["disk_folder_bytes"] <= t["limit"]["disk_bytes"], t  # nothing left behind by the kills
