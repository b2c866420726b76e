"""glibc's malloc, tuned for a model server: freed activation memory is kept for the next step instead
of being handed back to the kernel and faulted in again.

PyTorch on a CPU allocates every activation with malloc. glibc serves a block over its mmap threshold
(128 KiB, raised adaptively up to 32 MiB) with fresh pages from mmap and unmaps it on free, so each step
faults all of its large activations in again, and the kernel zeroes every page. A 2,048-token prefill
of SmolLM2-135M took 2.2 million page faults and 4 s of system time out of a 9.4 s step; with the
settings below it takes no fault and about 7 s. (PyTorch's CPU tuning guide preloads jemalloc or
tcmalloc for the same reason; this needs no preload and no package.)

The settings, applied once at process start (`tune()`):
- one arena (M_ARENA_MAX=1): the engine runs in a thread, and a thread's own arena grows in heaps of at
  most 64 MiB, so its larger blocks would still be mmapped whatever the threshold;
- mmap threshold and trim threshold 1 GiB: blocks up to 1 GiB come from the heap, and up to 1 GiB of
  free memory at its top stays mapped.
The cost: a process keeps the memory of its largest steps mapped, and more: chunks are placed best-fit
around the small blocks that land between them, so the heap grows for a few steps before it settles.
In tests/unit/test_allocator.py's pattern (128 MiB per step, in a thread) it settled after 3 to 10
steps at 2.5 to 6.5 times the step's working set (16 runs). That is host memory for activations,
bounded by the largest prefill chunk; on a GPU the activations live in torch's CUDA allocator and this
changes nothing for them.

`SPLITSERVE_MALLOC=system` leaves glibc's defaults. Nothing is changed where the choice was made
elsewhere (GLIBC_TUNABLES sets a malloc tunable, or LD_PRELOAD names another allocator), or off glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV = "SPLITSERVE_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>
KEEP_BYTES = 1 << 30
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def tune() -> str:
    """Apply the settings (again: harmless); returns what was done. An unknown SPLITSERVE_MALLOC is a
    ValueError naming it (the `splitserve` command prints it and exits 2)."""
    choice = os.environ.get(ENV, "keep").strip().lower()
    if choice == "system":
        return f"glibc malloc defaults ({ENV}=system)"
    if choice != "keep":
        raise ValueError(f"{ENV}={choice!r}: expected 'keep' (the default) or 'system'")
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return "allocator untouched (not glibc)"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "allocator untouched (GLIBC_TUNABLES sets malloc)"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in OTHER_ALLOCATORS):
        return f"allocator untouched (LD_PRELOAD={preload})"
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    for param, value in ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, KEEP_BYTES), (M_TRIM_THRESHOLD, KEEP_BYTES)):
        if libc.mallopt(param, value) != 1:
            return f"allocator partly tuned: mallopt({param}, {value}) refused"
    return "glibc malloc keeps freed memory (one arena, mmap and trim thresholds 1 GiB)"
