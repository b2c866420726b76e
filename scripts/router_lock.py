"""requirements-router.lock from requirements-run.lock: the router image's pins (`make lock` runs this).

The router imports neither torch nor the engine (tests/unit/test_import_contracts.py and the
[tool.importlinter] contracts keep it so), so its image leaves out torch and every package the run lock
pins only because torch (or another left-out package) needs it — read from uv's `# via` annotations.
Every remaining pin is the run lock's, byte for byte: the router runs exactly what CI tested.

    python scripts/router_lock.py requirements-run.lock > requirements-router.lock
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LEFT_OUT = frozenset({"torch"})  # what the router never imports; the rest follows from the annotations
HEADER = (
    "# The router image's pins: requirements-run.lock without torch and what only torch needs\n"
    "# (scripts/router_lock.py, run by `make lock`; do not edit)\n"
)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse(text: str) -> list[tuple[str, list[str], set[str]]]:
    """The lock's entries: (name, its lines, the packages it is there for)."""
    entries: list[tuple[str, list[str], set[str]]] = []
    for line in text.splitlines():
        m = PIN.match(line)
        if m:
            entries.append((_normal(m.group(1)), [line], set()))
        elif entries and line.startswith("    "):
            entries[-1][1].append(line)
            words = line.strip().removeprefix("#").split()
            if words[:1] == ["via"]:  # "# via" alone, or "# via torch" on one line
                words = words[1:]
            if words and words[0] not in ("-c", "-r"):  # a constraints or requirements file, no package
                entries[-1][2].add(_normal(words[0]))
    return entries


def router_lock(run_lock: str) -> str:
    entries = parse(run_lock)
    dropped = set(LEFT_OUT)
    changed = True
    while changed:  # a package goes when everything it is there for has gone
        changed = False
        for name, _, why in entries:
            if name not in dropped and why and why <= dropped:
                dropped.add(name)
                changed = True
    kept = [lines for name, lines, _ in entries if name not in dropped]
    return HEADER + "".join("\n".join(lines) + "\n" for lines in kept)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: router_lock.py RUN_LOCK", file=sys.stderr)
        return 2
    sys.stdout.write(router_lock(Path(sys.argv[1]).read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
