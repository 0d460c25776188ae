"""The level of each line llama-server prints, as its own marks give it (the wrapper logs them as `server.output`)."""

from __future__ import annotations

import json
import logging
import re

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
