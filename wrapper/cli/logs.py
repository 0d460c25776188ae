"""structlog setup: key-value events, readable on a terminal, JSON lines otherwise."""

from __future__ import annotations

import logging
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

