"""The command line's parts: a parser that answers a bad flag in one line, flags that carry their
environment variable and shown default (for `--help` and the generated table), the logging flags every
command has, and `splitserve config --markdown`, the table of every serving flag (docs/configuration.md
holds it; a test keeps the two equal)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError

from common.runtime.logs import LOG_FORMATS, LOG_LEVELS

SERVING_COMMANDS = ("up", "prefill", "decode", "router", "generate", "planner")  # what the table covers


_UNSET: Any = object()


class Parser(argparse.ArgumentParser):
    """No prefix matching (a mistyped `--tensor-parallel` must not become `--tensor-parallel-size`),
    and a bad flag is one line: the flag, what was wrong, the accepted values where there is a list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag(
    p: argparse.ArgumentParser,
    name: str,
    *,
    env: str | None = None,
    shown_default: Any = _UNSET,
    **kwargs: Any,
) -> argparse.Action:
    """add_argument, remembering the environment variable that sets the same thing and the default the
    command ends up with (the parser's own default is None wherever a config decides it, or comes from
    the environment: `shown_default` is then what the command does with neither)."""
    kwargs.setdefault("default", None)
    shown = kwargs["default"] if shown_default is _UNSET else shown_default
    takes_value = kwargs.get("action") in (None, "store")
    if takes_value and "choices" not in kwargs:
        kwargs.setdefault("metavar", name.removeprefix("--").upper().replace("-", "_"))
    notes = []
    if shown not in (None, {}, []) and takes_value:
        notes.append(f"default: {shown}")
    if env:
        notes.append(f"env {env}")
    kwargs["help"] = (kwargs.get("help") or "") + (f" [{'; '.join(notes)}]" if notes else "")
    action = p.add_argument(name, **kwargs)
    action.env = env  # type: ignore[attr-defined]
    action.shown_default = shown  # type: ignore[attr-defined]
    action.help_text = kwargs["help"].removesuffix(f" [{'; '.join(notes)}]" if notes else "")  # type: ignore[attr-defined]
    return action


def field_help(model: type[BaseModel], field: str) -> tuple[str, Any]:
    """A config field's description and default, for a flag that sets it."""
    info = model.model_fields[field]
    default = None if info.default_factory is not None else info.default
    return (info.description or field.replace("_", " ")), default


def add_log_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "--log-level", env="SPLITSERVE_LOG_LEVEL", choices=LOG_LEVELS, shown_default="info",
         help="what gets logged")  # fmt: skip
    flag(p, "--log-format", env="SPLITSERVE_LOG_FORMAT", choices=LOG_FORMATS, shown_default="text",
         help="text lines, or one JSON object per line (with the request id)")  # fmt: skip


def add_law_flags(p: argparse.ArgumentParser) -> None:
    """The planner's law and the forecast law's settings (`splitserve planner`, `up --autoscale`)."""
    flag(p, "--law", env="SPLITSERVE_PLANNER_LAW", choices=["reactive", "forecast"],
         default=env_or("SPLITSERVE_PLANNER_LAW") or "reactive", shown_default="reactive",
         help="reactive: from load and latency (planner/policy.py); forecast: ahead, from the arrivals "
         "the same minute had the previous period, corrected upward by today's (planner/forecast.py)",
         )  # fmt: skip
    flag(p, "--capacity-table", env="SPLITSERVE_PLANNER_CAPACITY_TABLE",
         default=env_or("SPLITSERVE_PLANNER_CAPACITY_TABLE"), shown_default=None,
         help="forecast law: a JSON file of the prefill and decode workers each request rate needs",
         )  # fmt: skip
    flag(p, "--forecast-period-s", type=float, default=86400.0,
         help="forecast law: the period traffic repeats over (a day; a week is 604800)")  # fmt: skip
    flag(p, "--forecast-lead-s", type=float, default=75.0,
         help="forecast law: how far ahead it asks for workers (a worker's start-up plus one interval)",
         )  # fmt: skip


def env_or(name: str, kind: Any = str) -> Any:
    """A parser default from an environment variable (None when unset or empty): for the flags of
    `up`, which no settings class reads. A bad value is one line, as a bad flag is."""
    value = os.environ.get(name) or None
    if value is None:
        return None
    try:
        return kind(value)
    except (ValueError, argparse.ArgumentTypeError) as e:
        sys.exit(f"splitserve: error: {name}={value!r}: {e}")


def parse_bool(value: str) -> bool:
    """An on/off environment variable: 1/true/yes/on or 0/false/no/off."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError("true or false")


def config_errors(e: ValidationError, flags: dict[str, str], env_prefix: str) -> str:
    """A settings ValidationError as one line per field, naming the flag and its variable."""
    lines = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        where = flags.get(field, f"--{field.replace('_', '-')}")
        got = err.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
        lines.append(f"error: {where} / {env_prefix}{field.upper()}: {err['msg']}{shown}")
    return "\n".join(lines)


def _default_text(action: argparse.Action) -> str:
    value = getattr(action, "shown_default", action.default)
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        return "on" if value else "off"
    if value is None or value == {} or value == argparse.SUPPRESS:
        return ""
    return f"`{value}`"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flag_rows(parser: argparse.ArgumentParser, commands: Iterable[str] = SERVING_COMMANDS) -> list[list[str]]:
    """One row per (flag, environment variable): the flag, the commands taking it, the variable, the
    default, the help. Flags are sorted by name; commands keep their order."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    rows: dict[tuple[str, str], list[str]] = {}
    for command, actions in [("splitserve", parser._actions)] + [
        (c, sub.choices[c]._actions) for c in commands
    ]:
        for action in actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
                continue
            name = (
                action.option_strings[0]
                if action.option_strings[0].startswith("--")
                else action.option_strings[-1]
            )
            env = getattr(action, "env", None) or ""
            help_text = getattr(action, "help_text", action.help or "").replace("%(prog)s", parser.prog)
            if action.choices and not isinstance(action.choices, dict):
                help_text += f" (one of {', '.join(map(str, action.choices))})"
            key = (name, env)
            if key in rows:
                rows[key][1] += f", {command}"
                default = _default_text(action)
                if default not in rows[key][3]:  # the same flag, another default (a service's port)
                    first = rows[key][1].split(", ")[0]
                    if "(" not in rows[key][3]:
                        rows[key][3] += f" ({first})"
                    rows[key][3] += f", {default} ({command})"
            else:
                rows[key] = [
                    f"`{name}`",
                    command,
                    f"`{env}`" if env else "",
                    _default_text(action),
                    help_text,
                ]
    return [[_escape(c) for c in row] for _, row in sorted(rows.items())]


def markdown_table(parser: argparse.ArgumentParser) -> str:
    head = ["Flag", "Commands", "Environment", "Default", "What it does"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in flag_rows(parser)]
    return "\n".join(lines) + "\n"
