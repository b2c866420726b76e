"""bench/throttle.py: a kernel read limit for the tier benchmarks' slow disk. The live test reads a cold
file inside the limit and checks the cgroup's own accounting saw those bytes (which proves the kernel
throttled them, without timing anything); it needs root and the cgroup v1 blkio controller."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.throttle import CGROUP, throttle_reads, whole_disk

BLKIO = CGROUP / "blkio" / "blkio.throttle.read_bps_device"


def test_a_limit_must_be_positive_and_on_a_block_device(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="above 0"), throttle_reads(tmp_path, 0):
        pass
    if Path("/dev/shm").is_dir() and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
        with pytest.raises(RuntimeError, match="not a block device"):
            whole_disk("/dev/shm")


@pytest.mark.skipif(
    os.geteuid() != 0 or not BLKIO.exists(), reason="needs root and the cgroup v1 blkio controller"
)
def test_cold_reads_inside_the_limit_go_through_the_throttled_group(tmp_path: Path) -> None:
    try:
        node = whole_disk(tmp_path)
    except RuntimeError as e:
        pytest.skip(str(e))
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    before = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    with throttle_reads(tmp_path, 64 << 20) as dev:
        assert dev == node
        group = CGROUP / "blkio" / f"splitserve-throttle-{os.getpid()}"
        assert (group / "blkio.throttle.read_bps_device").read_text().split() == [node, str(64 << 20)]
        while os.read(fd, 1 << 16):
            pass
        served = (group / "blkio.throttle.io_service_bytes").read_text().split("\n")
        read = sum(int(line.split()[2]) for line in served if line.startswith(f"{node} Read "))
        assert read >= 1 << 20, (
            f"the group read {read} bytes from {node}: the cold file's reads were not in it"
        )
    os.close(fd)
    assert not group.exists(), "the group is removed afterwards"
    assert Path(f"/proc/{os.getpid()}/cgroup").read_text() == before, "the process is back in its group"
