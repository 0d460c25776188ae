"""One part of an answer: what one pass's events gave the client, and what of them it had already.

An answer may take several passes to llama-server (after a growth, a lost server, a reload's hand-over, a pause);
each is a part. A part after the first echoes what it went on from and may generate again what the client has: it
must show only what the client lacks. Whatever the API (wrapper/answers/apis/), a part gives text, reasoning and
tool calls; this is where each is cut and counted. The API's reader says which field of an event is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """A tool call as its client has it: its id (once one came), its name, its arguments so far."""

    id: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class Had:
    """What the client has of an answer from its earlier parts that the next part must not show again: the text the
    next part echoes first (its prefix) and how many of its text events it generates again; the same for reasoning;
    and the tool calls the client has opened (made again by the next part, which shows only the rest)."""

    text: str = ""
    again: int = 0
    reasoning: str = ""
    again_reasoning: int = 0
    calls: list[Call] = field(default_factory=list)
    again_calls: int = 0  # the events of the calls generated again (their tokens, not shown twice)

    @property
    def anything(self) -> bool:
        return bool(self.text or self.again or self.reasoning or self.again_reasoning or self.calls)

    @property
    def generated_again(self) -> int:
        """Tokens the next part generates again that the client has (counted once in the whole answer)."""
        return self.again + self.again_reasoning + self.again_calls


@dataclass(frozen=True)
class Carry:
    """What the parts of an answer before this one gave its client: this part's id and counts are made the whole
    answer's (llama-server counts only the part it generates, and the text it went on from as prompt)."""

    id: str | None  # the answer's (its first part's) id
    shown: int  # tokens the client has from the earlier parts
    again: int  # of those, how many this part generates again (not shown twice)
    prompt_tokens: int | None = None  # the request's own prompt, when known
    prompt: str | None = None  # a completion's: the request's own prompt text

    @property
    def earlier(self) -> int:
        """Tokens of the earlier parts this part does not count."""
        return self.shown - self.again

    def counts(self, prompt: int, generated: int) -> tuple[int, int]:
        """The whole answer's (prompt, generated) tokens from this part's: its prompt held the earlier parts' text."""
        own = self.prompt_tokens if self.prompt_tokens is not None else max(0, prompt - self.earlier)
        return own, generated + self.earlier

    def id_of(self, payload: dict[str, Any]) -> bool:
        """Give `payload` the answer's id; whether it changed."""
        if self.id is not None and isinstance(payload.get("id"), str) and payload["id"] != self.id:
            payload["id"] = self.id
            return True
        return False

    def openai(self, payload: dict[str, Any]) -> bool:
        """An OpenAI-shaped event (chat, text completion): its id and `usage` made the whole answer's."""
        changed = self.id_of(payload)
        usage = payload.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            prompt, completion = self.counts(int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"]))
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
            changed = True
        return changed


class Part:
    """What one pass's events gave the client (read by the API's reader, field by field), and what of them the client
    had from the earlier parts (`had`: not shown again). `continuing`: a part after the first (the API drops what
    opens an answer a second time)."""

    def __init__(self, had: Had | None = None, continuing: bool = False) -> None:
        self.had = had or Had()
        self.continuing = continuing
        self.content: list[str] = []  # the text shown, a piece per event
        self.reasoning: list[str] = []  # the reasoning shown, a piece per event
        self.calls: dict[int, Call] = {}  # the tool calls shown, by index
        self.call_tokens = 0  # events that carried a part of a tool call
        self.tokens = 0  # events that carried text
        self.plain = True  # only text so far: an assistant prefix can go on from it
        self.id: str | None = None  # the first id its events carried
        self.first: dict[str, Any] | None = None  # its first event (a gathered answer's id, created, model)
        self.final: dict[str, Any] | None = None  # the event that said why the generation stopped
        self.decoded: int | None = None  # the tokens generated so far, as llama-server counted them (its per-token
        # timings, when the request asked for them)
        self._skip, self._again = self.had.text, self.had.again
        self._skip_reasoning, self._again_reasoning = self.had.reasoning, self.had.again_reasoning
        self._args_had = {k: call.arguments for k, call in enumerate(self.had.calls)}  # what each call's client
        # has still to come again (the rest of its arguments is shown)

    def saw(self, payload: dict[str, Any]) -> None:
        """Any event: the first one, the first id, and the count of tokens generated that it carries."""
        if self.first is None:
            self.first = payload
        if self.id is None and isinstance(payload.get("id"), str):
            self.id = payload["id"]
        timings = payload.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("predicted_n"), int):
            self.decoded = timings["predicted_n"]

    def ended(self, payload: dict[str, Any]) -> None:
        self.final = payload

    def text(self, piece: str) -> str | None:
        """A text event's piece: what of it the client lacks, None when it has all of it (after the echoed prefix,
        after the events generated again — dropped by count: at temperature 0 they are the text the client has;
        should they differ, the client's text stands and the answer goes on after them)."""
        kept = self._cut(piece, reasoning=False)
        if kept is not None:
            self.content.append(kept)
            self.tokens += 1
        return kept

    def thought(self, piece: str) -> str | None:
        """A reasoning event's piece: what of it the client lacks (as `text`, for reasoning)."""
        self.plain = False
        kept = self._cut(piece, reasoning=True)
        if kept:
            self.reasoning.append(kept)
        return kept

    def _cut(self, piece: str, reasoning: bool) -> str | None:
        skip = self._skip_reasoning if reasoning else self._skip
        if skip:
            if piece.startswith(skip):
                piece, skip = piece[len(skip):], ""
            elif skip.startswith(piece):
                skip, piece = skip[len(piece):], ""
            else:
                skip = ""  # not an echo after all: show everything from here
            if reasoning:
                self._skip_reasoning = skip
            else:
                self._skip = skip
            if not piece:
                return None
        if reasoning and self._again_reasoning:
            self._again_reasoning -= 1
            return None
        if not reasoning and self._again:
            self._again -= 1
            return None
        return piece

    def opened(self, k: int, call_id: str | None, name: str) -> bool:
        """The `k`th tool call of this part opens: False when the client has it open already (made again: it is not
        opened a second time, and keeps the client's id and name)."""
        self.plain = False
        if k < len(self.had.calls):
            had = self.had.calls[k]
            self.calls.setdefault(k, Call(had.id, had.name))
            return False
        call = self.calls.setdefault(k, Call())
        call.id = call.id or call_id
        call.name = call.name or name
        return True

    def arguments(self, k: int, piece: str) -> str:
        """A piece of the `k`th call's arguments: what of it the client lacks (a call made again shows only what
        comes after the client's arguments)."""
        self.plain = False
        self.call_tokens += 1
        if k < len(self.had.calls):
            self.opened(k, None, "")
            piece = self._new_arguments(k, piece)
        self.calls.setdefault(k, Call()).arguments += piece
        return piece

    def reopened(self, k: int) -> bool:
        """Whether the `k`th call is one the client had open."""
        return k < len(self.had.calls)

    def _new_arguments(self, k: int, piece: str) -> str:
        left = self._args_had.get(k, "")
        if left:  # what of these the client has is not shown again
            if piece.startswith(left):
                piece, left = piece[len(left):], ""
            elif left.startswith(piece):
                piece, left = "", left[len(piece):]
            else:
                left = ""  # they part ways: the client's stand, and the rest goes on after them
            self._args_had[k] = left
        return piece
