"""What the Responses and Messages APIs share: events named in an `event:` line, and an answer's frame — items with
ids (Responses) or content blocks with indexes (Messages) — that a part after the first must show under the client's
ids (wrapper/answers/apis/responses.py, wrapper/answers/apis/messages.py).

llama-server makes both from its chat parser: text, reasoning and tool calls come as deltas inside items or blocks.
A part that goes on after a loss opens a new response (a new id, new item ids, new call ids) and echoes the prefix it
was given. So in a part after the first: the opening events are dropped; an item or block the client has open is
not opened again, its events shown under the client's id or index; the echoed text and reasoning are cut off as in
chat, a call made again shows only what its client lacks; the closing events carry the client's ids and the whole
answer's counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wrapper.answers.apis.api import Api, Verdict
from wrapper.answers.part import Part


@dataclass
class Shown:
    """What a Responses or Messages client was shown of its answer's frame, across the parts: the answer's id, its
    reasoning and text (Responses: item ids; Messages: block indexes), its calls (Responses: item id and call_id;
    Messages: block index), and (Messages) how many blocks it has."""

    id: str | None = None
    kinds: dict[str, Any] = field(default_factory=dict)  # "reasoning" / "text" -> item id or block index
    calls: list[Any] = field(default_factory=list)
    blocks: int = 0


def named(payload: dict[str, Any]) -> bytes:
    """An event framed as these APIs frame theirs: its type in an `event:` line, then its data."""
    return f"event: {payload.get('type')}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class TypedApi(Api):
    """An API of named events and a frame of ids (Responses, Messages): its reader is a TypedReader of its own."""

    message = True
    reading: type[TypedReader]

    def frame(self) -> Shown:
        return Shown()

    def reader(self, part: Part, frame: object | None) -> TypedReader:
        assert isinstance(frame, Shown)
        return self.reading(part, frame)

    def event(self, payload: dict[str, Any]) -> bytes:
        return named(payload)


class TypedReader:
    """One part's events of a Responses or Messages stream (`shown`: what the client has of its frame, shared by the
    parts); the two APIs read their own event types and meet here for the deltas and the ids."""

    def __init__(self, part: Part, shown: Shown) -> None:
        self.part, self.shown = part, shown
        self.ids: dict[str, str] = {}  # this part's ids -> the client's
        self.call_of: dict[Any, int] = {}  # an item id (Responses) or block index (Messages) -> its call
        self.opened = 0  # calls opened in this part

    def read(self, payload: dict[str, Any]) -> Verdict:
        kind = payload.get("type")
        if not isinstance(kind, str):
            return Verdict.AS_IT_CAME
        if self.part.continuing:
            self.client_ids(kind, payload)
            mapped = _mapped(payload, self.ids)
            payload.clear()
            payload.update(mapped)
        verdict = self.typed(kind, payload)
        if verdict is Verdict.AS_IT_CAME and self.part.continuing:
            return Verdict.CHANGED  # under the client's ids
        return verdict

    def typed(self, kind: str, payload: dict[str, Any]) -> Verdict:
        raise NotImplementedError

    def client_ids(self, kind: str, payload: dict[str, Any]) -> None:
        """Learn this part's ids for what the client has (before the event is shown under them)."""

    # -- what a delta carries -------------------------------------------------------------------------------------

    def text(self, holder: dict[str, Any], key: str) -> Verdict:
        return _kept(holder, key, self.part.text)

    def thought(self, holder: dict[str, Any], key: str) -> Verdict:
        return _kept(holder, key, self.part.thought)

    def arguments(self, k: int | None, holder: dict[str, Any], key: str) -> Verdict:
        if k is None or not isinstance(holder.get(key), str):
            return Verdict.AS_IT_CAME
        return _kept(holder, key, lambda piece: self.part.arguments(k, piece), empty_too=True)

    def call_opens(self, call_id: str | None, name: str) -> tuple[int, bool]:
        """The next call of this part opens: its index among the answer's calls, and whether it is new to the client
        (False: made again, the client has it open)."""
        k = self.opened
        self.opened += 1
        return k, self.part.opened(k, call_id, name)


def _kept(holder: dict[str, Any], key: str, cut: Callable[[str], str | None], empty_too: bool = False) -> Verdict:
    """A delta's piece (`holder[key]`) as the part cuts it: what the client lacks of it."""
    given = holder.get(key)
    if not isinstance(given, str) or (not given and not empty_too):
        return Verdict.AS_IT_CAME
    kept = cut(given)
    if not kept:
        return Verdict.DROPPED
    if kept == given:
        return Verdict.AS_IT_CAME
    holder[key] = kept
    return Verdict.CHANGED


def _mapped(value: Any, ids: dict[str, str]) -> Any:
    """`value` with every string that is one of `ids` replaced by what it maps to."""
    if not ids:
        return value
    if isinstance(value, str):
        return ids.get(value, value)
    if isinstance(value, dict):
        return {key: _mapped(item, ids) for key, item in value.items()}
    if isinstance(value, list):
        return [_mapped(item, ids) for item in value]
    return value
