"""Paired measurements that survive a noisy machine: the sides of a comparison alternate in short rounds
(A B, B A, A B, ...), so outside load lands on every side alike, and the result is the median of the
per-round ratios with their spread, next to the machine's load average before and after."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

T = TypeVar("T")


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def alternate(sides: dict[str, Callable[[], T]], rounds: int, progress: str = "") -> dict[str, list[T]]:
    """Call every side once per round, `rounds` times; the order reverses every other round (A B, B A, ...)
    so that no side always runs right after another. Returns each side's results, in round order.
    `progress`: a progress bar with this label, a tick per side run."""
    out: dict[str, list[T]] = {name: [] for name in sides}
    names = list(sides)
    with tqdm(
        total=rounds * len(names), desc=progress, unit="side", leave=False, disable=not progress
    ) as bar:
        for i in range(rounds):
            for name in names if i % 2 == 0 else reversed(names):
                out[name].append(sides[name]())
                bar.update(1)
    return out


def median(xs: Sequence[float]) -> float:
    return float(np.median(xs))


def spread(xs: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """median, min, max and interquartile range [q25, q75] of per-round values."""
    q25, q75 = np.percentile(xs, [25, 75])
    return {
        "median": round(median(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
        "iqr": [round(float(q25), digits), round(float(q75), digits)],
    }


def ratio_stats(a: Sequence[float], b: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """`spread` of the per-round ratios a[i] / b[i]."""
    assert len(a) == len(b) and a, "one value per round on each side"
    return spread([x / y for x, y in zip(a, b, strict=True)], digits)


def ratio_keys(stats: dict[str, Any]) -> dict[str, Any]:
    """A `ratio_stats` result as the JSON keys every paired scenario reports: ratio (the median),
    ratio_min, ratio_max, ratio_iqr."""
    return {
        "ratio": stats["median"],
        "ratio_min": stats["min"],
        "ratio_max": stats["max"],
        "ratio_iqr": stats["iqr"],
    }
