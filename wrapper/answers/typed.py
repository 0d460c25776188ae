"""The Responses and Messages APIs' event streams (`POST /v1/responses`, `POST /v1/messages`), read and, in a part
after a loss of the server, rewritten as chat's are (wrapper/answers/sse.py), so that the client sees one answer.

llama-server makes both from its chat parser: text, reasoning and tool calls come as deltas inside items
(Responses: a reasoning item, a message item with one output_text part, a function_call item per call, each with an
id) or content blocks (Messages: thinking, text, a tool_use block per call, each with an index). A part that goes
on after a loss opens a new response (a new id, new item ids, new call ids) and echoes the prefix it was given. So
in a part after the first:

- the response's opening events (`response.created`, `response.in_progress`; `message_start`) are dropped;
- an item or block the client has open is not opened again: its events are shown under the client's id or index,
  and a new one gets the next index the client has not seen;
- the echoed text and reasoning are cut off as in chat, a call made again shows only what its client lacks;
- the closing events (the items' `done`, `response.completed`; the blocks' stops, `message_delta`) carry the
  client's ids and the whole answer's token counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from wrapper import paths
from wrapper.answers.sse import Carry, Events, Had


@dataclass
class Shown:
    """What a Responses or Messages client was shown of its answer's frame, across the parts: the answer's id, its
    reasoning and text (Responses: item ids; Messages: block indexes), its calls (Responses: item id and call_id;
    Messages: block index), and (Messages) how many blocks it has."""

    id: str | None = None
    kinds: dict[str, Any] = field(default_factory=dict)  # "reasoning" / "text" -> item id or block index
    calls: list[Any] = field(default_factory=list)
    blocks: int = 0


class TypedEvents(Events):
    """One part's events of a Responses or Messages stream (`shown`: what the client has of its frame, shared by
    the parts)."""

    def __init__(self, path: str, shown: Shown, skip: str = "", continuing: bool = False, again: int = 0,
                 carry: Carry | None = None, had: Had | None = None) -> None:
        super().__init__(True, skip=skip, continuing=continuing, holds=False, again=again, carry=carry, had=had)
        self.responses = path in paths.RESPONSES
        self.shown = shown
        self._ids: dict[str, str] = {}  # this part's ids -> the client's
        self._blocks: dict[int, int] = {}  # Messages: this part's block indexes -> the client's
        self._call_of: dict[Any, int] = {}  # an item id (Responses) or block index (Messages) -> its call
        self._opened = 0  # calls opened in this part
        self._reopened: set[str] = set()  # Responses: the client's items this part opened again

    def _payload(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        kind = payload.get("type")
        if not isinstance(kind, str):
            return raw
        if self.continuing:
            payload = self._client_ids(payload)
        shown = self._responses(kind, payload) if self.responses else self._messages(kind, payload)
        if shown is None:
            return None
        if shown is _AS_IT_CAME and not self.continuing:
            return raw
        return _event(kind, payload)

    # -- Responses ------------------------------------------------------------------------------------------------

    def _responses(self, kind: str, payload: dict[str, Any]) -> object | None:
        if kind in ("response.created", "response.in_progress"):
            response = payload.get("response") or {}
            if self.shown.id is None:
                self.shown.id = response.get("id")
            return None if self.continuing else _AS_IT_CAME
        if kind == "response.output_item.added":
            return self._item_added(payload.get("item") or {})
        if kind == "response.content_part.added":
            return None if payload.get("item_id") in self._reopened else _AS_IT_CAME
        if kind == "response.output_text.delta":
            return self._text_delta(payload, "delta")
        if kind == "response.reasoning_text.delta":
            return self._reasoning_delta(payload, "delta")
        if kind == "response.function_call_arguments.delta":
            return self._arguments_delta(self._call_of.get(payload.get("item_id")), payload, "delta")
        if kind == "response.completed":
            self._final = payload
            response = payload.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            if self.carry is not None and isinstance(usage, dict):
                prompt, generated = self.carry.counts(int(usage.get("input_tokens") or 0),
                                                      int(usage.get("output_tokens") or 0))
                usage.update(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
                return _CHANGED
        return _AS_IT_CAME

    def _item_added(self, item: dict[str, Any]) -> object | None:
        kind, given = item.get("type"), item.get("id")
        if kind == "function_call":
            k = self._opened
            self._opened += 1
            if k < len(self.had.calls):  # made again: the client has it open
                self._call_of[self.shown.calls[k][0]] = k
                return None
            self.shown.calls.append((given, item.get("call_id")))
            self._call_of[given] = k
            self._calls[k] = (item.get("call_id"), str(item.get("name") or ""), "")
            return _AS_IT_CAME
        key = "reasoning" if kind == "reasoning" else "text"
        if key in self.shown.kinds:  # the client has it open (its id stood in for this part's)
            self._reopened.add(self.shown.kinds[key])
            return None
        self.shown.kinds[key] = given
        return _AS_IT_CAME

    # -- Messages -------------------------------------------------------------------------------------------------

    def _messages(self, kind: str, payload: dict[str, Any]) -> object | None:
        if kind == "message_start":
            message = payload.get("message") or {}
            if self.shown.id is None:
                self.shown.id = message.get("id")
            return None if self.continuing else _AS_IT_CAME
        index = payload.get("index")
        if kind == "content_block_start" and isinstance(index, int):
            return self._block_started(index, payload)
        outcome: object | None = _AS_IT_CAME
        if isinstance(index, int) and self._blocks.get(index, index) != index:
            payload["index"] = self._blocks[index]
            outcome = _CHANGED
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                said = self._text_delta(delta, "text")
            elif delta.get("type") == "thinking_delta":
                said = self._reasoning_delta(delta, "thinking")
            elif delta.get("type") == "input_json_delta":
                said = self._arguments_delta(self._call_of.get(payload.get("index")), delta, "partial_json")
            else:
                said = _AS_IT_CAME
            return said if said is not _AS_IT_CAME else outcome
        if kind == "message_delta":
            self._final = payload
            usage = payload.get("usage")
            if self.carry is not None and isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                usage["output_tokens"] = self.carry.counts(0, usage["output_tokens"])[1]
                return _CHANGED
        return outcome

    def _block_started(self, index: int, payload: dict[str, Any]) -> object | None:
        block = payload.get("content_block") or {}
        kind = block.get("type")
        if kind == "tool_use":
            k = self._opened
            self._opened += 1
            if k < len(self.had.calls):  # made again: the client has it open
                self._blocks[index] = self.shown.calls[k]
                self._call_of[self.shown.calls[k]] = k
                return None
            self._blocks[index] = self.shown.blocks
            self.shown.calls.append(self.shown.blocks)
            self._call_of[self.shown.blocks] = k
            self._calls[k] = (block.get("id"), str(block.get("name") or ""), "")
        else:
            key = "reasoning" if kind == "thinking" else "text"
            if key in self.shown.kinds:
                self._blocks[index] = self.shown.kinds[key]
                return None  # the client has it open
            self._blocks[index] = self.shown.kinds[key] = self.shown.blocks
        self.shown.blocks += 1
        if self._blocks[index] == index:
            return _AS_IT_CAME
        payload["index"] = self._blocks[index]
        return _CHANGED

    # -- what a delta carries ---------------------------------------------------------------------------------------

    def _text_delta(self, holder: dict[str, Any], key: str) -> object | None:
        given = holder.get(key)
        if not isinstance(given, str) or not given:
            return _AS_IT_CAME
        kept = self._cut_prefix(given)
        if not kept:
            return None
        self._content.append(kept)
        self._tokens += 1
        if kept == given:
            return _AS_IT_CAME
        holder[key] = kept
        return _CHANGED

    def _reasoning_delta(self, holder: dict[str, Any], key: str) -> object | None:
        given = holder.get(key)
        if not isinstance(given, str) or not given:
            return _AS_IT_CAME
        self._plain = False
        kept = self._cut_reasoning(given)
        if not kept:
            return None
        self._reasoning.append(kept)
        if kept == given:
            return _AS_IT_CAME
        holder[key] = kept
        return _CHANGED

    def _arguments_delta(self, k: int | None, holder: dict[str, Any], key: str) -> object | None:
        given = holder.get(key)
        if k is None or not isinstance(given, str):
            return _AS_IT_CAME
        self._plain = False
        self._call_tokens += 1
        kept = self._new_arguments(k, given) if k < len(self.had.calls) else given
        if k < len(self.had.calls) and k not in self._calls:
            had = self.had.calls[k]
            self._calls[k] = (had[0], had[1], "")
        call_id, name, shown = self._calls.get(k, (None, "", ""))
        self._calls[k] = (call_id, name, shown + kept)
        if not kept:
            return None
        if kept == given:
            return _AS_IT_CAME
        holder[key] = kept
        return _CHANGED

    def _client_ids(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A continuation's event under the ids its client has: this part's response, items and calls are the
        client's (learnt as they open)."""
        kind = payload.get("type")
        if kind in ("response.created", "response.in_progress", "message_start"):
            opened = payload.get("response") or payload.get("message") or {}
            if isinstance(opened.get("id"), str) and self.shown.id is not None:
                self._ids[opened["id"]] = self.shown.id
        elif kind == "response.output_item.added":
            self._learn(payload.get("item") or {})
        mapped = _mapped(payload, self._ids)
        return mapped if isinstance(mapped, dict) else payload

    def _learn(self, item: dict[str, Any]) -> None:
        """The client's ids for an item this part opens again (one the client has open)."""
        kind, given = item.get("type"), item.get("id")
        if not isinstance(given, str):
            return
        if kind == "function_call":
            k = self._opened
            if k < len(self.had.calls) and k < len(self.shown.calls):
                item_id, call_id = self.shown.calls[k]
                self._ids[given] = item_id
                if isinstance(item.get("call_id"), str) and isinstance(call_id, str):
                    self._ids[item["call_id"]] = call_id
            return
        had = self.shown.kinds.get("reasoning" if kind == "reasoning" else "text")
        if isinstance(had, str):
            self._ids[given] = had


_AS_IT_CAME = object()  # the event goes on as llama-server sent it
_CHANGED = object()  # the event goes on rewritten


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


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
