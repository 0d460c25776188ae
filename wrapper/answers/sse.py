"""A llama-server event stream passed through event by event, its last events held back, so that a streamed
answer cut by a full context can go on in the same stream after a growth.

Held back: the event that says why the generation stopped (a chat chunk with a `finish_reason`, a
`/completion` event with `stop: true`) and whatever follows it (`data: [DONE]`). In a continuation, the
role-only first chunk is dropped and the assistant prefix llama-server echoes at the start is cut off, so the
client sees one answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_FINAL = re.compile(rb'"finish_reason"\s*:\s*"|"stop"\s*:\s*true|\[DONE\]')  # an event a stream ends with


@dataclass
class Had:
    """What the client has of a chat answer from its earlier parts that the next part must not show again: the
    reasoning it echoes first (its prefill) and the reasoning events a resume generates again, and the tool calls
    the client has opened (id, name, arguments so far: made again by the next part, which shows only the rest)."""

    reasoning: str = ""
    again_reasoning: int = 0
    calls: list[tuple[str | None, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Carry:
    """What the parts of a resumed answer before this one gave its client: this part's id and counts are made
    the whole answer's (llama-server counts only the part it generates, and the text it went on from as prompt)."""

    id: str | None  # the answer's (its first part's) id
    shown: int  # tokens the client has from the earlier parts
    again: int  # of those, how many this part generates again (not shown twice)
    prompt_tokens: int | None = None  # the request's own prompt, when known
    prompt: str | None = None  # /completion: the request's own prompt text

    def counts(self, prompt: int, generated: int) -> tuple[int, int]:
        """The whole answer's (prompt, generated) tokens from this part's: its prompt held the earlier parts' text."""
        earlier = self.shown - self.again  # tokens of the earlier parts this part does not count
        return (self.prompt_tokens if self.prompt_tokens is not None else max(0, prompt - earlier)), generated + earlier

    def carries(self, payload: dict[str, Any]) -> bool:
        """Make `payload`'s id and counts the whole answer's; whether anything changed."""
        changed = False
        if self.id is not None and isinstance(payload.get("id"), str) and payload["id"] != self.id:
            payload["id"], changed = self.id, True
        earlier = self.shown - self.again  # tokens of the earlier parts this part does not count
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            prompt, completion = self.counts(int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"]))
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            changed = True
        if payload.get("stop") is True and isinstance(payload.get("tokens_predicted"), int):  # /completion's last
            payload["tokens_predicted"] += earlier
            if self.prompt_tokens is not None:
                payload["tokens_evaluated"] = self.prompt_tokens
            if self.prompt is not None:
                payload["prompt"] = self.prompt
            changed = True
        return changed


class Events:
    def __init__(self, chat: bool, skip: str = "", continuing: bool = False, holds: bool = True,
                 again: int = 0, carry: Carry | None = None, had: Had | None = None) -> None:
        self.chat = chat
        self.had = had or Had()
        self.carry = carry
        self.continuing = continuing
        self.holds = holds  # False: the stop event goes on too (a stream watched only to be resumed if cut)
        self._skip = skip  # text the continuation echoes first (the assistant prefix), not shown again
        self._again = again  # then this many events of text the client has already: generated again by a resume
        self._buffer = b""
        self.held: list[bytes] = []
        # A first pass rewrites nothing: its events go on as they come, read only when asked (a cut, a pause, the end).
        self._fast = not (skip or again or continuing or carry is not None or had is not None)
        self._unread: list[bytes] = []  # whole events passed on, not read yet
        self._final: dict[str, Any] | None = None
        self._content: list[str] = []
        self._reasoning: list[str] = []  # a chat answer's reasoning passed on, a piece per event
        self._calls: dict[int, tuple[str | None, str, str]] = {}  # its tool calls passed on: index -> id, name, args
        self._call_tokens = 0
        self._skip_reasoning = self.had.reasoning
        self._again_reasoning = self.had.again_reasoning
        self._args_had = {i: call[2] for i, call in enumerate(self.had.calls)}  # what each call's client has still
        # to come again (the rest of its arguments is shown)
        self._tokens = 0
        self._plain = True
        self._id: str | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The event that said why the generation stopped, once it came."""
        self._read()
        return self._final

    @property
    def content(self) -> list[str]:
        """The text passed on (after the cut prefix), a piece per event."""
        self._read()
        return self._content

    @property
    def reasoning(self) -> list[str]:
        """A chat answer's reasoning passed on, a piece per event."""
        self._read()
        return self._reasoning

    @property
    def calls(self) -> dict[int, tuple[str | None, str, str]]:
        """A chat answer's tool calls as passed on: index -> (id, name, the arguments shown)."""
        self._read()
        return self._calls

    @property
    def call_tokens(self) -> int:
        self._read()
        return self._call_tokens

    @property
    def tokens(self) -> int:
        """Events that carried text: the tokens generated, as llama-server streams one an event."""
        self._read()
        return self._tokens

    @property
    def plain(self) -> bool:
        """Only text so far (no reasoning, no tool call): an assistant prefix can go on from it."""
        self._read()
        return self._plain

    @property
    def id(self) -> str | None:
        """The first id its events carried (a chat answer's)."""
        self._read()
        return self._id

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` goes to the client now: whole events, the held ones excepted."""
        self._buffer += chunk
        if self._fast and not self.held:
            end = self._buffer.rfind(b"\n\n")
            if end < 0:
                return b""
            whole = self._buffer[:end + 2]
            if not self.holds or _FINAL.search(whole) is None:  # nothing to hold back in it: on as it came
                self._buffer = self._buffer[end + 2:]
                self._unread.append(whole)
                return whole
        self._read()
        out: list[bytes] = []
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            passed = self._event(raw + b"\n\n")
            if passed:
                out.append(passed)
        return b"".join(out)

    def _read(self) -> None:
        """Read the events passed on unread (what they carried: text, the id, the final event)."""
        unread, self._unread = self._unread, []
        for whole in unread:
            for raw in whole.split(b"\n\n")[:-1]:
                self._event(raw + b"\n\n")  # a first pass holds nothing back there: only what it carried counts

    def release(self) -> bytes:
        """The held events and any unfinished rest, for when the stream ends as llama-server ended it."""
        return b"".join(self.held) + self._buffer

    def _event(self, raw: bytes) -> bytes | None:
        if self.held:
            self.held.append(raw)
            return None
        text = raw.decode("utf-8", "replace").strip()
        data = _data(text)
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
        if self._id is None and isinstance(payload.get("id"), str):
            self._id = payload["id"]
        return self._payload(raw, payload)

    def _payload(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        """What of one event (its JSON `payload`) goes to the client, and what it carried."""
        if self.carry is not None and self.carry.carries(payload):
            raw = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
        return self._chat(raw, payload) if self.chat else self._completion(raw, payload)

    def _chat(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        choices = payload.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return raw
        choice = choices[0]
        if choice.get("finish_reason"):
            self._final = payload
            if not self.holds:
                return raw
            self.held.append(raw)
            return None
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return raw
        changed = False
        if isinstance(thought := delta.get("reasoning_content"), str) and thought:
            self._plain = False
            kept = self._cut_reasoning(thought)
            if kept != thought:
                changed = True
                if kept:
                    delta["reasoning_content"] = kept
                else:
                    del delta["reasoning_content"]
            if kept:
                self._reasoning.append(kept)
        if isinstance(calls := delta.get("tool_calls"), list) and calls:
            self._plain = False
            shown = [part for call in calls if isinstance(call, dict) and (part := self._call(call)) is not None]
            if shown != calls:
                changed = True
                if shown:
                    delta["tool_calls"] = shown
                else:
                    del delta["tool_calls"]
        content = delta.get("content")
        if isinstance(content, str) and content:
            kept = self._cut_prefix(content)
            if kept != content:
                changed = True
                delta["content"] = kept or None
            if kept:
                self._content.append(kept)
                self._tokens += 1
        if not changed:
            if self.continuing and "role" in delta and not content and not thought and not calls:
                return None  # the continuation's own role chunk: the client has one
            return raw
        if not (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
            return None  # all of it was the client's already
        if self.continuing:
            delta.pop("role", None)
        return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"

    def _call(self, part: dict[str, Any]) -> dict[str, Any] | None:
        """One tool call's part as the client is shown it: a call it has opened already comes again in the next part
        (after a loss: a new id, its name again, its arguments from the start) and is shown only what it lacks."""
        given = part.get("index")
        index = given if isinstance(given, int) else len(self._calls)
        given_function = part.get("function")
        function: dict[str, Any] = given_function if isinstance(given_function, dict) else {}
        given_arguments = function.get("arguments")
        arguments = given_arguments if isinstance(given_arguments, str) else ""
        self._call_tokens += 1
        if index < len(self.had.calls):
            had_id = self.had.calls[index][0]
            arguments = self._new_arguments(index, arguments)
            seen = self._calls.get(index, (had_id, self.had.calls[index][1], ""))
            self._calls[index] = (seen[0], seen[1], seen[2] + arguments)
            if not arguments:
                return None
            return {"index": index, "function": {"arguments": arguments}}
        seen = self._calls.get(index, (None, "", ""))
        given_id, given_name = part.get("id"), function.get("name")
        call_id = given_id if isinstance(given_id, str) else seen[0]
        name = given_name if isinstance(given_name, str) and not seen[1] else seen[1]
        self._calls[index] = (call_id, name, seen[2] + arguments)
        return part

    def _new_arguments(self, index: int, arguments: str) -> str:
        """What of a call's arguments, made again by this part, the client lacks (the client's stand)."""
        left = self._args_had.get(index, "")
        if left:  # what of these the client has is not shown again
            if arguments.startswith(left):
                arguments, left = arguments[len(left):], ""
            elif left.startswith(arguments):
                arguments, left = "", left[len(arguments):]
            else:
                left = ""  # they part ways: the client's stand, and the rest goes on after them
            self._args_had[index] = left
        return arguments

    def _cut_reasoning(self, thought: str) -> str:
        """What of a reasoning event is new to the client: after the reasoning the continuation echoes, and after
        the events a resume generates again."""
        if self._skip_reasoning:
            if thought.startswith(self._skip_reasoning):
                thought, self._skip_reasoning = thought[len(self._skip_reasoning):], ""
                if not thought:
                    return ""
            elif self._skip_reasoning.startswith(thought):
                self._skip_reasoning = self._skip_reasoning[len(thought):]
                return ""
            else:
                self._skip_reasoning = ""
        if self._again_reasoning:
            self._again_reasoning -= 1
            return ""
        return thought

    def _completion(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        if payload.get("stop"):
            self._final = payload
            if not self.holds:
                return raw
            self.held.append(raw)
            return None
        content = payload.get("content")
        if isinstance(content, str):
            kept = self._cut_prefix(content) if self.continuing else content
            if kept != content:
                if not kept:
                    return None  # the client has it: generated again after a resume
                payload["content"] = kept
                raw = b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
            self._content.append(kept)
            self._tokens += 1
        return raw

    def _cut_prefix(self, content: str) -> str:
        """What of an event's text is new to the client: after the echoed prefix, and after the events a resume
        generates again (dropped by count: at temperature 0 they are the text the client has; should they differ,
        the client's text stands and the answer goes on after them)."""
        if self._skip:
            if content.startswith(self._skip):
                content, self._skip = content[len(self._skip):], ""
                if not content:
                    return ""
            elif self._skip.startswith(content):
                self._skip = self._skip[len(content):]
                return ""
            else:
                self._skip = ""  # not an echo after all: show everything from here
        if self._again:
            self._again -= 1
            return ""
        return content


def _data(text: str) -> str | None:
    """An event's data (its `data:` line; the Responses and Messages APIs name their events in an `event:` line
    before it); None for an event without one."""
    if text.startswith("data:"):
        return text[5:].strip()
    at = text.find("\ndata:")
    return text[at + 6:].strip() if at >= 0 else None


def as_answer(chat: bool, final: dict[str, Any]) -> dict[str, Any]:
    """A stream's last event in the shape of a whole answer, for wrapper/answers/continuation.py."""
    if not chat:
        return final
    timings = final.get("timings") or {}
    generated = int(timings.get("predicted_n") or 0)
    used = int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0) + generated
    usage = final.get("usage") or {"total_tokens": used, "completion_tokens": generated}
    return {"choices": [{"finish_reason": final["choices"][0].get("finish_reason"), "message": {}}], "usage": usage}
