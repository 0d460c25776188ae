"""Which way a proxied request goes, and the shape its answer is read in: two pure decisions, made before any I/O
(wrapper/answers/forwarding.py acts on them; tests/unit/wrapper/test_route.py has their tables).

A request goes one of four ways:

- REMEMBERED: a GET clients poll while the server sleeps, answered from what it said awake (it does not wake it);
- SHOWN: a GET whose answer a built-in rewrites (what clients are told of the server: the media built-in);
- THROUGH: streamed both ways as it comes (GET and HEAD; a POST nothing needs again: no step, no growth, no
  watchdog, no seat; a body too large to keep);
- WHOLE: its body read whole, the built-ins' steps run on it, and its answer read in a shape.

An answer read whole is read in one of three shapes:

- STREAM: an event stream passed on as it comes, its end held back while it may have to go on (after a growth, a
  lost server, a reload's hand-over, a pause);
- GATHERED: one JSON answer asked for by a request that may be paused, sent as a stream (llama-server stops only a
  stream whose client goes away) and gathered into that answer;
- WHOLE: anything else, caught whole when it is a JSON answer a growth may send again or continue.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

BODY_LIMIT = 32 << 20  # a request read whole (for a step, or to be sent again after a growth)


class Way(Enum):
    REMEMBERED = "remembered"
    SHOWN = "shown"
    THROUGH = "through"
    WHOLE = "whole"


class Shape(Enum):
    STREAM = "stream"
    GATHERED = "gathered"
    WHOLE = "whole"


def way(method: str, asleep_answer: bool, shown: bool, post_needs_body: bool, length: int | None) -> Way:
    """The way a request goes: `asleep_answer`, the server sleeps and remembers this GET's answer; `shown`, a
    built-in rewrites this GET's answer; `post_needs_body`, a step, a growth, the watchdog or a seat needs a POST's
    body again; `length`, its Content-Length."""
    if method == "GET" and asleep_answer:
        return Way.REMEMBERED
    if method == "GET" and shown:
        return Way.SHOWN
    if method != "POST" or not post_needs_body or (length or 0) > BODY_LIMIT:
        return Way.THROUGH
    return Way.WHOLE


def shape(payload: dict[str, Any] | None, continuing: bool, resumable: bool, pausable: bool) -> Shape:
    """The shape an answer is read in: a stream that may go on (an answer a full context cut, with a growth that
    continues it; one the watchdog resumes after a loss; one that may be paused) is read event by event; a JSON
    answer that may be paused is gathered from a stream; anything else whole."""
    streamed = payload is not None and payload.get("stream") is True
    if streamed and (continuing or resumable or pausable):
        return Shape.STREAM
    if pausable:
        return Shape.GATHERED
    return Shape.WHOLE
