"""One pass's event stream as its client gets it: split into events as they come, each read by the answer's API
(wrapper/answers/apis/) into the part (wrapper/answers/part.py), and its end — the event that says why the
generation stopped, and whatever follows it (`data: [DONE]`) — held back while the answer may have to go on in the
same stream (after a growth). A first pass rewrites nothing: its events go on as they come and are read only when
asked (a cut, a pause, the end), so that the hot path parses no JSON.
"""

from __future__ import annotations

import json
import re

from wrapper.answers.apis.api import Api, Verdict
from wrapper.answers.part import Carry, Part


class Events:
    """`holds`: the end is held back; `carry`: what the earlier parts gave (this part's id and counts are made the
    whole answer's); `frame`: the answer's frame across its parts (the API's); `passes_on` False: nothing goes to the
    client (a gathered answer), every event is read as it comes; `untimed`: the wrapper asked for per-token timings
    the client did not (wrapper/answers/answer.py), and the events before the end are passed on without them."""

    def __init__(self, api: Api, part: Part | None = None, holds: bool = True, carry: Carry | None = None,
                 frame: object | None = None, passes_on: bool = True, untimed: bool = False) -> None:
        self.api = api
        self.untimed = untimed
        self._part = part or Part()
        self.reader = api.reader(self._part, frame)
        self.holds = holds
        self.carry = carry
        self.held: list[bytes] = []
        self._buffer = b""
        self._fast = passes_on and carry is None and not self._part.continuing and not self._part.had.anything
        self._unread: list[bytes] = []  # whole events passed on, not read yet

    @property
    def part(self) -> Part:
        """What the events passed on gave the client (read now, if they were not)."""
        self._read()
        return self._part

    @property
    def final(self) -> dict[str, object] | None:
        """The event that said why the generation stopped, once it came."""
        return self.part.final

    @property
    def tokens(self) -> int:
        """Events that carried text: the tokens generated, as llama-server streams one an event."""
        return self.part.tokens

    @property
    def plain(self) -> bool:
        """Only text so far (no reasoning, no tool call): an assistant prefix can go on from it."""
        return self.part.plain

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` goes to the client now: whole events, the held ones excepted."""
        self._buffer += chunk
        if self._fast and not self.held:
            end = self._buffer.rfind(b"\n\n")
            if end < 0:
                return b""
            whole = self._buffer[:end + 2]
            if not self.holds or self.api.final.search(whole) is None:  # nothing to hold back: on as it came
                self._buffer = self._buffer[end + 2:]
                self._unread.append(whole)  # read with its timings, when asked
                return _untimed(self.api, whole) if self.untimed else whole
        self._read()
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            passed = self._event(raw + b"\n\n")
            if passed:
                out.append(passed)
        return b"".join(out)

    def release(self) -> bytes:
        """The held events and any unfinished rest, for when the stream ends as llama-server ended it."""
        return b"".join(self.held) + self._buffer

    def _read(self) -> None:
        unread, self._unread = self._unread, []
        for whole in unread:
            for raw in whole.split(b"\n\n")[:-1]:
                self._event(raw + b"\n\n")  # a first pass holds nothing back there: only what it carried counts

    def _event(self, raw: bytes) -> bytes | None:
        if self.held:
            self.held.append(raw)
            return None
        data = _data(raw.decode("utf-8", "replace").strip())
        if data is None:
            return raw
        if data == "[DONE]":
            if not self.holds:
                return raw
            self.held.append(raw)
            return None
        try:
            payload = json.loads(data)
        except ValueError:
            return raw
        if not isinstance(payload, dict):
            return raw
        self._part.saw(payload)
        carried = self.carry is not None and self.api.carried(payload, self.carry)
        verdict = self.reader.read(payload)
        if verdict is Verdict.DROPPED:
            return None
        if self.untimed and payload is not self._part.final and "usage" not in payload and "timings" in payload:
            del payload["timings"]
            carried = True
        out = self.api.event(payload) if verdict is Verdict.CHANGED or carried else raw
        if self.holds and self._part.final is payload:
            self.held.append(out)
            return None
        return out


_TIMINGS = re.compile(rb',"timings":\{[^{}]*\}|"timings":\{[^{}]*\},')  # llama-server's compact JSON: a flat object


def _untimed(api: Api, whole: bytes) -> bytes:
    """Whole events as their client asked for them: without the per-token timings the wrapper asked for, but for the
    end's (the final event and the usage carry them whether asked or not)."""
    if b'"timings":{' not in whole:
        return whole
    events = [event + b"\n\n" for event in whole.split(b"\n\n")[:-1]]
    return b"".join(event if api.final.search(event) or b'"usage"' in event else _TIMINGS.sub(b"", event)
                    for event in events)


def _data(text: str) -> str | None:
    """An event's data (its `data:` line; the Responses and Messages APIs name their events in an `event:` line
    before it); None for an event without one."""
    if text.startswith("data:"):
        return text[5:].strip()
    at = text.find("\ndata:")
    return text[at + 6:].strip() if at >= 0 else None
