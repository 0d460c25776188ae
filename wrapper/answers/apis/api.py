"""What an API of llama-server's says about its answers, so that the request path can go on with one it was cut
in: how its stream is framed, how an event is read (text, reasoning, a tool call, the end), the request that goes
on from an answer so far, the one JSON answer gathered from a stream, and what a part after the first must carry.

Each API is one module beside this one (chat, completion, infill, Responses, Messages); wrapper/answers/apis/__init__.py
names them by path. Events (wrapper/answers/events.py) frames a stream and hands each event to the API's reader.
"""

from __future__ import annotations

import copy
import json
import re
from enum import Enum
from typing import Any, ClassVar, Protocol

from wrapper.answers.part import Carry, Part
from wrapper.steps import LIMITS, error_body, limit

GOES_ON_NOT = {
    "api": "its API's answers are not paused (chat completions' and /completion's are; the others go on after a "
           "loss of the server)",
    "tools": "its request offers tools: after a pause it would not go on exactly (a tool call is made again)",
    "choices": "it asks for several choices",
}
"""Why an answer cannot go on from what its client has, by code (the priority.not_paused reason)."""



class Verdict(Enum):
    """What one event of a stream comes to for its client, as its API reads it (the event that says why the
    generation stopped is the part's `final`: held back while the answer may have to go on)."""

    AS_IT_CAME = "as it came"  # passed on unchanged
    CHANGED = "changed"  # passed on as the reader rewrote it
    DROPPED = "dropped"  # the client has all of it


class Reader(Protocol):
    """One part's events of one API, read one at a time into the part (wrapper/answers/part.py)."""

    def read(self, payload: dict[str, Any]) -> Verdict: ...


class Api:
    """One API's answers. The defaults are those of an API whose events are `data:` lines of JSON."""

    name: ClassVar[str]
    paths: ClassVar[tuple[str, ...]]
    message: ClassVar[bool] = False  # its answer is an assistant message: text, reasoning, tool calls
    growable: ClassVar[bool] = False  # an answer a full context cut goes on after a growth
    pausable: ClassVar[bool] = False  # a background answer is paused and goes on exactly (pinned to its slot)
    exact: ClassVar[bool] = True  # it goes on from a prefix exactly; else it is generated again from the start
    seeded: ClassVar[bool] = False  # llama-server takes its request's `seed`: an answer made again comes the same
    timed: ClassVar[bool] = False  # with `timings_per_token`, its events count the tokens generated so far
    final: ClassVar[re.Pattern[bytes]] = re.compile(rb'"finish_reason"\s*:\s*"|\[DONE\]')  # an event it ends with

    def frame(self) -> object | None:
        """What the client was shown of the answer's frame across its parts (Responses, Messages); None."""
        return None

    def reader(self, part: Part, frame: object | None) -> Reader:
        raise NotImplementedError

    def event(self, payload: dict[str, Any]) -> bytes:
        """A rewritten event, framed as the API frames it."""
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        """An error answered whole, in this API's shape (OpenAI's and llama-server's: `{"error": {...}}`)."""
        return error_body(status, message, kind)

    def error_event(self, status: int, message: str, kind: str) -> bytes:
        """The event a stream of this API ends with when the wrapper cannot finish it (OpenAI's clients raise on a
        `data:` line whose object has an `error`)."""
        return b"data: " + json.dumps(self.error_body(status, message, kind), ensure_ascii=False).encode() + b"\n\n"

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        """Make `payload`'s id and counts the whole answer's; whether anything changed."""
        return carry.id_of(payload)

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        """The request that goes on from an answer's `text` and `reasoning` so far (its limit not yet reduced)."""
        raise NotImplementedError

    def gathered(self, last: Part, said: Said, prompt_tokens: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        """The one JSON answer of a request whose answer was gathered from streams: what every part `said`, the
        rest from the `last` one (its first event is the answer's first); `prompt_tokens`, the request's own prompt
        when known; `asked`, the request as it came."""
        raise NotImplementedError

    def as_answer(self, final: dict[str, Any]) -> dict[str, Any]:
        """A stream's last event in the shape of the whole JSON answer (for `cut_by_context`)."""
        return final

    def cut_by_context(self, request: dict[str, Any], answer: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
        """(tokens used, tokens still wanted) when `answer` stopped at a full context with tokens left in the
        request's limit; None otherwise (or when the API's answers are not grown for)."""
        return None

    def said(self, answer: dict[str, Any]) -> tuple[str, str, int]:
        """A whole JSON answer's text, reasoning and the tokens it generated (for a growth that continues it)."""
        raise NotImplementedError

    def merged(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """One JSON answer from one a full context cut and its continuation after a growth."""
        raise NotImplementedError

    def cannot_go_on(self, request: dict[str, Any]) -> str | None:
        """Why an answer to `request` cannot go on after a loss of the server (a code of GOES_ON_NOT); None: it can."""
        return "choices" if request.get("n") not in (None, 1) else None

    def cannot_pause(self, request: dict[str, Any]) -> str | None:
        """Why a background answer to `request` cannot be paused and go on exactly (a code of GOES_ON_NOT)."""
        if not self.pausable:
            return "api"
        return self.cannot_go_on(request) or ("tools" if request.get("tools") else None)


class Other(Api):
    """A path whose answers are not read (embeddings, tokenize, ...): they are sent again whole after a loss, before
    any of them reached the client, and never continued."""

    name = "other"
    paths = ()

    def cannot_go_on(self, request: dict[str, Any]) -> str | None:
        return "api"


class Said(Protocol):
    """What every part of an answer gave its client (wrapper/answers/continuation.py's SoFar)."""

    @property
    def text(self) -> str: ...

    @property
    def tokens(self) -> int: ...

    @property
    def thought(self) -> str: ...

    @property
    def tool_calls(self) -> list[dict[str, Any]]: ...


def less(request: dict[str, Any], generated: int) -> dict[str, Any]:
    """`request` (a copy) with its limit less what was generated."""
    body = copy.deepcopy(request)
    for key in LIMITS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            body[key] = max(1, value - generated)
    return body


def wanted(request: dict[str, Any], used: int, generated: int, n_ctx: int) -> tuple[int, int] | None:
    """(used, still wanted) when `used` tokens filled the context with tokens left in the request's limit."""
    if used < n_ctx - 1:
        return None  # the request's own limit stopped it, not the context
    asked = limit(request)
    left = (asked - generated) if asked is not None else None
    if left is not None and left <= 0:
        return None
    return used, left if left is not None else 0


def prompt_of(prompt_tokens: int | None, said: Said, last: Part) -> int:
    """The request's own prompt tokens: as counted, else the last part's prompt less the earlier parts' answer."""
    if prompt_tokens is not None:
        return prompt_tokens
    timings = timings_of(last.final)
    last_prompt = int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0)
    return max(0, last_prompt - (said.tokens - last.tokens))


def timings_of(final: dict[str, Any] | None) -> dict[str, Any]:
    given = (final or {}).get("timings")
    return given if isinstance(given, dict) else {}


def identity(first: dict[str, Any], final: dict[str, Any]) -> dict[str, Any]:
    """A gathered answer's id, creation time, model and fingerprint: its first event's (the last's, failing that)."""
    return {key: first.get(key, final.get(key)) for key in ("id", "created", "model", "system_fingerprint")}
