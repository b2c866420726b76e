"""Logging for every splitserve process: one handler on stderr, text or JSON lines, the request id.

`configure_logging(level, fmt, process=...)` is called once at the start of each command (the CLI's
--log-level / --log-format; defaults from SPLITSERVE_LOG_LEVEL and SPLITSERVE_LOG_FORMAT). It installs
one stderr handler on the root logger (again: replaced, never doubled) and routes uvicorn's loggers
through it. uvicorn's own access log stays off: `common.runtime.access.AccessLog` writes ours, one
line per request on "splitserve.access".

    text   2025-06-01T12:00:00.123Z INFO decode-0 splitserve.engine: engine on device=cpu, ...
           2025-06-01T12:00:01.456Z INFO decode-0 splitserve.access [req-1f2e]: POST /internal/... 200
    json   {"ts": "2025-06-01T12:00:00.123Z", "level": "info", "process": "decode-0",
            "logger": "splitserve.engine", "msg": "engine on ...", "request_id": ..., "exc": ...}

Nothing logged can forge a line: in text mode every control character (CR, LF, ESC, the rest of C0
and C1, DEL, U+2028/9) in the message and in every field is written as an escape (`\\n`, `\\x1b`), and
the lines of a traceback are indented under their record; JSON escapes them by itself. A request path
with %0a in it is therefore one line, wherever it is logged.

The request id comes from a context variable the access middleware sets for each request, so a line
logged anywhere while a request is handled carries it. `progress()` shows a bar (tqdm) for long start-up
work when stderr is a terminal and the format is text; otherwise it logs a line at the start and end.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
LEVEL_ENV, FORMAT_ENV = "SPLITSERVE_LOG_LEVEL", "SPLITSERVE_LOG_FORMAT"
# Libraries that log every connection or poll at info/debug: at warning unless the level is debug.
NOISY = ("httpx", "httpx2", "httpcore", "asyncio", "urllib3", "hpack", "multipart", "python_multipart")
UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.asgi")
# Libraries that install a handler of their own when first imported (NIXL: its own format, on stdout).
OWN_HANDLERS = ("nixl",)

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
T = TypeVar("T")

# C0, DEL, C1, and the Unicode line and paragraph separators (str.splitlines() breaks on those too)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: object) -> str:
    """`text` on one line: control characters as escapes (\\n, \\r, \\t, \\x1b, \\u2028, ...). A string
    without any is returned as it is, so escaping twice changes nothing."""
    s = text if isinstance(text, str) else str(text)
    return _CONTROL.sub(_escape_char, s)


def current_request_id() -> str | None:
    """The id of the request being handled in this context (None outside a request)."""
    return request_id_var.get()


class _Settings:
    level = "info"
    fmt = "text"
    process = "splitserve"
    handler: logging.Handler | None = None


_settings = _Settings()


def _iso(created: float) -> str:
    t = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Fields a record may carry (logging's `extra=`) that the JSON format writes as keys of their own.
EXTRA_FIELDS = ("method", "path", "status", "duration_ms", "client")


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <process> <logger> [<request id>]: <message>`, every field escaped; a traceback's
    lines follow, each indented with "  | " (so none of them can pass for a record of its own)."""

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        head = f"{_iso(record.created)} {record.levelname} {escape(_settings.process)} {escape(record.name)}"
        if rid:
            head += f" [{escape(rid)}]"
        line = f"{head}: {escape(record.getMessage())}"
        extra = _exception_text(self, record)
        if extra:
            line += "".join(f"\n  | {escape(part)}" for part in extra.splitlines())
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO-8601, UTC), level, process, logger, msg, then request_id when
    known, the access fields (method, path, status, duration_ms, client) when given, exc when any.
    json.dumps (ASCII) escapes every control character, so a record is always one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "process": _settings.process,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        for key in EXTRA_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        exc = _exception_text(self, record)
        if exc:
            out["exc"] = exc
        return json.dumps(out, default=str)


def _exception_text(fmt: logging.Formatter, record: logging.LogRecord) -> str:
    parts = []
    if record.exc_info:
        parts.append(fmt.formatException(record.exc_info))
    if record.stack_info:
        parts.append(fmt.formatStack(record.stack_info))
    return "\n".join(parts)


class _RequestIdFilter(logging.Filter):
    """Stamps each record with the request id of the context that logged it (unless it names one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = request_id_var.get()
        return True


def _choice(value: str | None, env: str, default: str, allowed: tuple[str, ...], what: str) -> str:
    source = f"{env}=" if value is None and os.environ.get(env) else ""
    raw = value if value is not None else (os.environ.get(env) or default)
    choice = raw.strip().lower()
    if choice not in allowed:
        raise ValueError(f"{source or what + ' '}{raw!r}: expected one of {', '.join(allowed)}")
    return choice


def configure_logging(
    level: str | None = None,
    fmt: str | None = None,
    *,
    process: str | None = None,
    stream: IO[str] | None = None,
) -> None:
    """Log to `stream` (default stderr) at `level` in format `fmt` ("text" or "json"), each record naming
    `process` ("router", "decode-0", ...). None takes SPLITSERVE_LOG_LEVEL / SPLITSERVE_LOG_FORMAT, else
    info / text; a `process` of None keeps the one named before (at first "splitserve"). Idempotent:
    calling it again replaces its handler. An unknown level or format is a ValueError, one line naming
    the accepted values."""
    lvl = _choice(level, LEVEL_ENV, "info", LOG_LEVELS, "log level")
    form = _choice(fmt, FORMAT_ENV, "text", LOG_FORMATS, "log format")
    _settings.level, _settings.fmt = lvl, form
    if process is not None:
        _settings.process = process
    root = logging.getLogger()
    if _settings.handler is not None:
        root.removeHandler(_settings.handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JSONFormatter() if form == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    root.addHandler(handler)
    _settings.handler = handler
    root.setLevel(lvl.upper())
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.NOTSET if lvl == "debug" else logging.WARNING)
    for name in UVICORN:  # through the root's handler, at the root's level
        lg = logging.getLogger(name)
        lg.handlers, lg.propagate = [], True
        lg.setLevel(logging.NOTSET)
    access = logging.getLogger("uvicorn.access")  # off: AccessLog writes ours
    access.handlers, access.propagate = [], False
    access.setLevel(logging.CRITICAL + 1)
    logging.captureWarnings(True)  # warnings.warn(...) becomes a record too (one JSON line, not two raw)
    adopt_loggers()  # those already imported


def adopt_loggers(names: tuple[str, ...] = OWN_HANDLERS) -> None:
    """Route loggers that a library gave a handler of its own through ours (their handlers removed,
    their records propagated, at our level). A no-op before configure_logging. Call it after the
    library is imported: NIXL configures its logger on import, and `Service` calls this once the
    services' KV backend is chosen (and again at start)."""
    if _settings.handler is None:
        return
    for name in names:
        lg = logging.getLogger(name)
        lg.handlers, lg.propagate = [], True
        lg.setLevel(logging.NOTSET)


def is_configured() -> bool:
    return _settings.handler is not None


def log_format() -> str:
    """The configured format ("text" before configure_logging, or the environment's)."""
    if _settings.handler is None:
        env = (os.environ.get(FORMAT_ENV) or "text").strip().lower()
        return env if env in LOG_FORMATS else "text"
    return _settings.fmt


def reset_logging() -> None:
    """Undo configure_logging (for tests): its handler removed, the root at warning, warnings raw."""
    root = logging.getLogger()
    if _settings.handler is not None:
        root.removeHandler(_settings.handler)
    _settings.handler = None
    _settings.level, _settings.fmt, _settings.process = "info", "text", "splitserve"
    root.setLevel(logging.WARNING)
    for name in (*NOISY, *UVICORN, "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.NOTSET)
        lg.propagate = True
    logging.captureWarnings(False)


# --- progress -------------------------------------------------------------------------------------
def show_bars() -> bool:
    """A progress bar goes to stderr only when it is a terminal, the format is text and info shows."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(
        isatty is not None
        and isatty()
        and log_format() == "text"
        and logging.getLogger().isEnabledFor(logging.INFO)
    )


def progress(
    items: Iterable[T],
    what: str,
    *,
    total: int | None = None,
    unit: str = "tensor",
    logger: logging.Logger | None = None,
) -> Iterator[T]:
    """Yield `items`, showing progress: a tqdm bar on a terminal (text format), else a line logged at
    the start ("<what>: <total> <unit>s ...") and one at the end ("<what>: <n> <unit>s in <s> s")."""
    log = logger or logging.getLogger("splitserve")
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    if show_bars():
        from tqdm import tqdm

        bar = tqdm(items, desc=what, total=total, unit=unit, file=sys.stderr, leave=False, disable=None)
        yield from bar
        return
    count = f"{total} {unit}s" if total is not None else f"{unit}s"
    log.info("%s: %s ...", what, count)
    t0, n = time.monotonic(), 0
    for item in items:
        n += 1
        yield item
    log.info("%s: %d %ss in %.1f s", what, n, unit, time.monotonic() - t0)
