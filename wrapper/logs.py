"""structlog setup: key-value events, readable on a terminal, JSON lines otherwise."""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Literal, TextIO

import structlog

LogFormat = Literal["auto", "console", "json"]
LEVELS = ("debug", "info", "warning", "error")


class _Stream:
    """stderr that never raises: a reader gone away (a closed pipe) must not break a signal handler or a stop."""

    def __init__(self, stream: TextIO) -> None:
        self._stream: TextIO | None = stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                self._stream.write(text)
            except (OSError, ValueError):
                self._stream = None
        return len(text)

    def flush(self) -> None:
        if self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._stream = None


class _LibraryRecords(logging.Handler):
    """Records of the libraries (aiohttp's "Error handling request" for a malformed request, asyncio's notes) as
    one key-value event each: a client must not be able to write tracebacks or raw bytes into our log."""

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, object] = {"logger": record.name, "message": _short(record.getMessage())}
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            fields["error"] = _short(f"{type(error).__name__}: {error}")
        # aiohttp.server's errors are a client's malformed requests: worth a note, not an error of ours.
        client_made = record.name.startswith("aiohttp.server")
        level = logging.WARNING if client_made or record.levelno < logging.ERROR else logging.ERROR
        structlog.get_logger().log(level, "library.log", **fields)


_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # --log-colors on
# llama.cpp's common log (common/log.cpp) with its prefix on, as llama-server sets it: an optional "M.SS.mmm.uuu"
# timestamp, then the level letter (I, W, E, D) and a space.
_PREFIXED = re.compile(r"(?:\d+\.\d{2}\.\d{3}\.\d{3} )?([IWED]) ")
# Older llama-server builds: "ERR [    function] message" and "WARN [ ..."; and an argument error, printed before
# the log starts, without a prefix: 'error while handling argument "-fa": ...', "error: invalid argument: ...".
_WORDED = re.compile(r"\s*(ERR|ERROR|WARN|WARNING) +\[|(error|warning)(?::| while handling )", re.IGNORECASE)
_NAMED = {"e": logging.ERROR, "err": logging.ERROR, "error": logging.ERROR,
          "w": logging.WARNING, "warn": logging.WARNING, "warning": logging.WARNING}


def server_line_level(line: str) -> int | None:
    """The level llama-server gave one of its output lines when it marked it an error or a warning (its log
    prefix's E or W, --log-jsonl's "level", older builds' ERR/WARN); None for any other line."""
    text = _COLOURS.sub("", line)
    if text.startswith("{"):  # --log-jsonl (and older builds' JSON log lines)
        try:
            record = json.loads(text)
        except ValueError:
            return None
        level = record.get("level") if isinstance(record, dict) else None
        return _NAMED.get(level.lower()) if isinstance(level, str) else None
    if (prefixed := _PREFIXED.match(text)) is not None:
        return _NAMED.get(prefixed.group(1).lower())
    if (worded := _WORDED.match(text)) is not None:
        return _NAMED[(worded.group(1) or worded.group(2)).lower()]
    return None


def server_output_level(line: str, shown: bool) -> int:
    """The level of a `server.output` event: llama-server's own error and warning marks first; any other line
    at info, or at debug when the built-ins call it noise (`shown` False: -lv 4's extra lines)."""
    marked = server_line_level(line)
    if marked is not None:
        return marked
    return logging.INFO if shown else logging.DEBUG


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def configure(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Configure structlog for the process; `auto` picks console when stderr is a terminal."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    else:
        renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=_Stream(sys.stderr)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(handlers=[_LibraryRecords()], level=logging.WARNING, force=True)

