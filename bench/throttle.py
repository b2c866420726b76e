"""A real read limit on a block device for this process: a slow or shared disk (a network volume, a
busy device) without one at hand. The kernel enforces it: the process joins a cgroup of its own whose
blkio controller (cgroup v1: `blkio.throttle.read_bps_device`) caps the bytes a second it reads from
the device holding `path` (cgroup v2's `io.max` is not supported yet). Only reads that reach the
device are slowed: drop a file from the page cache first (posix_fadvise DONTNEED) for its reads to
count. Needs root and that controller; anything else is a clear error, never a silent full-speed run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def whole_disk(path: str | os.PathLike[str]) -> str:
    """The MAJ:MIN of the whole disk holding `path` (a partition's own number is not throttled: its
    reads are submitted to the disk)."""
    dev = os.stat(path).st_dev
    node = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = Path("/sys/dev/block") / node
    if not sysfs.exists():
        raise RuntimeError(
            f"{path} is on device {node}, not a block device (tmpfs, overlay?): nothing to throttle"
        )
    if (sysfs / "partition").exists():
        node = (sysfs.resolve().parent / "dev").read_text().strip()
    return node


@contextlib.contextmanager
def throttle_reads(path: str | os.PathLike[str], bytes_per_s: int) -> Iterator[str]:
    """Cap this process's reads from the disk holding `path` at `bytes_per_s` until the block ends
    (the process, every thread, moves into a cgroup of its own and back). Yields the device."""
    if bytes_per_s <= 0:
        raise ValueError(f"a read limit must be above 0, got {bytes_per_s}")
    node = whole_disk(path)
    parent = CGROUP / "blkio"
    if not (parent / "blkio.throttle.read_bps_device").exists():
        raise RuntimeError(
            "throttling reads needs the cgroup v1 blkio controller at /sys/fs/cgroup/blkio (cgroup v2's "
            "io.max is not supported by this bench yet)"
        )
    group = parent / f"splitserve-throttle-{os.getpid()}"
    limit, value = "blkio.throttle.read_bps_device", f"{node} {bytes_per_s}"
    try:
        group.mkdir(exist_ok=True)
        (group / limit).write_text(value)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        with contextlib.suppress(OSError):
            group.rmdir()
        raise RuntimeError(f"could not throttle reads from {node} in {group} ({e}): this needs root") from e
    try:
        yield node
    finally:
        with contextlib.suppress(OSError):
            (parent / "cgroup.procs").write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            group.rmdir()
