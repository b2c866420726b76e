"""What every bench's plot does around its own drawing: matplotlib without a display (imported only
when a plot is drawn: the benches run without it until then), and the figure written to its file."""

from __future__ import annotations

import os
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str, dpi: float | None = None) -> None:
    """Lay `fig` out, write it to `path` (its folder made), and free it."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if dpi is None:
        fig.savefig(path)
    else:
        fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
