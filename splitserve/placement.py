"""Which GPUs each service of `splitserve up` gets: its own CUDA_VISIBLE_DEVICES, the ranks of a
tensor-parallel service on consecutive devices, as the compose file and the chart give each container
or pod its own devices. Pure functions: the tests check the plan and the environment each child gets."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


class PlacementError(ValueError):
    """An impossible plan; the message names the counts."""


def parse_devices(text: str) -> list[str]:
    """ "0,1,2" -> ["0", "1", "2"]; device ids are integers or GPU UUIDs (as CUDA_VISIBLE_DEVICES takes)."""
    devices = [d.strip() for d in text.split(",")]
    if not text.strip() or any(not d for d in devices):
        raise PlacementError(f"expected comma-separated device ids such as 0,1,2; got {text!r}")
    return devices


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]  # what CUDA_VISIBLE_DEVICES says for this service
    share: int  # services sharing the busiest of these devices (1: the devices are its own)


def plan(
    n_prefill: int,
    n_decode: int,
    tp: int,
    devices: list[str] | None = None,
    prefill_devices: list[str] | None = None,
    decode_devices: list[str] | None = None,
) -> list[Placement] | None:
    """The devices of each service, prefill services first, then decode ones (the order `up` starts
    them in); None when no devices were named (every service sees what `up` sees).

    A role's own list (`--prefill-devices`) must hold exactly its services x tp devices; the roles named
    by no list of their own take consecutive devices from `--devices`, prefill first. A device may
    appear twice only on purpose (`--devices 0,0`: two services share GPU 0, each sizing its KV cache
    from its share of --gpu-memory-utilization)."""
    if devices is None and prefill_devices is None and decode_devices is None:
        return None
    need = {"prefill": n_prefill * tp, "decode": n_decode * tp}
    given = {"prefill": prefill_devices, "decode": decode_devices}
    for role, own in given.items():
        if own is not None and len(own) != need[role]:
            raise PlacementError(
                f"--{role}-devices names {len(own)} device(s); {_count(role, need[role] // tp, tp)} "
                f"need {need[role]}"
            )
    rest = [role for role in ("prefill", "decode") if given[role] is None and need[role]]
    pool = list(devices or [])
    wanted = sum(need[role] for role in rest)
    if rest and len(pool) < wanted:
        named = " + ".join(_count(role, need[role] // tp, tp) for role in rest)
        source = f"--devices names {len(pool)} device(s)" if devices is not None else "no --devices given"
        raise PlacementError(f"{source}; {named} need {wanted}")
    lists: dict[str, list[str]] = {}
    for role in ("prefill", "decode"):
        own = given[role]
        if own is None:
            own, pool = pool[: need[role]], pool[need[role] :]
        lists[role] = own
    per_service = [
        tuple(lists[role][i * tp : (i + 1) * tp])
        for role, n in (("prefill", n_prefill), ("decode", n_decode))
        for i in range(n)
    ]
    users: dict[str, int] = {}
    for devs in per_service:
        for d in set(devs):
            users[d] = users.get(d, 0) + 1
    for devs in per_service:
        if len(set(devs)) != len(devs):
            raise PlacementError(
                f"a tensor-parallel service needs {tp} distinct devices; got {','.join(devs)}"
            )
    return [Placement(devs, max(users[d] for d in devs)) for devs in per_service]


def _count(role: str, n: int, tp: int) -> str:
    what = f"{n} {role} service{'s' if n != 1 else ''}"
    return what if tp == 1 else f"{what} at --tensor-parallel-size {tp}"


def visible_gpus() -> list[str] | None:
    """The GPUs `up` can place services on without being told: CUDA_VISIBLE_DEVICES where it is set,
    else the ones `nvidia-smi` lists; None on a machine without an NVIDIA driver (as here)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in (x.strip() for x in env.split(",")) if d] or None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return found if out.returncode == 0 and found else None


def spread(gpus: list[str], n_services: int, tp: int) -> list[str]:
    """The `--devices` list `up` uses when none is given and GPUs are visible: each service its own
    devices when there are enough, else round-robin (services share, and split the memory)."""
    need = n_services * tp
    return [gpus[i % len(gpus)] for i in range(need)]
