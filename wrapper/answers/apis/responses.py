"""OpenAI Responses (`POST /v1/responses`, Codex's API): named events (wrapper/answers/apis/typed.py).

Read: `response.created` and `response.in_progress` open it; `response.output_item.added` opens a reasoning item,
a message item (one `output_text` part) or a `function_call` item (its `call_id` and name); deltas carry text
(`response.output_text.delta`), reasoning (`response.reasoning_text.delta`) and a call's arguments
(`response.function_call_arguments.delta`), each under its item's id; `response.completed` ends it with the usage.
Goes on: the input, then the answer so far as a reasoning item and an assistant message (llama-server merges them
into one assistant message, which it continues).
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.apis.api import Verdict
from wrapper.answers.apis.typed import Shown, TypedApi, TypedReader
from wrapper.answers.part import Carry, Part
from wrapper.steps import error_body


class _Reader(TypedReader):
    def __init__(self, part: Part, shown: Shown) -> None:
        super().__init__(part, shown)
        self.reopened: set[str] = set()  # the client's items this part opened again

    def typed(self, kind: str, payload: dict[str, Any]) -> Verdict:
        if kind in ("response.created", "response.in_progress"):
            response = payload.get("response") or {}
            if self.shown.id is None:
                self.shown.id = response.get("id")
            return Verdict.DROPPED if self.part.continuing else Verdict.AS_IT_CAME
        if kind == "response.output_item.added":
            return self._item_added(payload.get("item") or {})
        if kind == "response.content_part.added":
            return Verdict.DROPPED if payload.get("item_id") in self.reopened else Verdict.AS_IT_CAME
        if kind == "response.output_text.delta":
            return self.text(payload, "delta")
        if kind == "response.reasoning_text.delta":
            return self.thought(payload, "delta")
        if kind == "response.function_call_arguments.delta":
            return self.arguments(self.call_of.get(payload.get("item_id")), payload, "delta")
        if kind == "response.completed":
            self.part.ended(payload)
        return Verdict.AS_IT_CAME

    def _item_added(self, item: dict[str, Any]) -> Verdict:
        kind, given = item.get("type"), item.get("id")
        if kind == "function_call":
            k, new = self.call_opens(item.get("call_id"), str(item.get("name") or ""))
            if not new:  # made again: the client has it open
                self.call_of[self.shown.calls[k][0]] = k
                return Verdict.DROPPED
            self.shown.calls.append((given, item.get("call_id")))
            self.call_of[given] = k
            return Verdict.AS_IT_CAME
        key = "reasoning" if kind == "reasoning" else "text"
        if key in self.shown.kinds:  # the client has it open (its id stood in for this part's)
            self.reopened.add(self.shown.kinds[key])
            return Verdict.DROPPED
        self.shown.kinds[key] = given
        return Verdict.AS_IT_CAME

    def client_ids(self, kind: str, payload: dict[str, Any]) -> None:
        if kind in ("response.created", "response.in_progress"):
            opened = payload.get("response") or {}
            if isinstance(opened.get("id"), str) and self.shown.id is not None:
                self.ids[opened["id"]] = self.shown.id
        elif kind == "response.output_item.added":
            self._learn(payload.get("item") or {})

    def _learn(self, item: dict[str, Any]) -> None:
        """The client's ids for an item this part opens again (one the client has open)."""
        kind, given = item.get("type"), item.get("id")
        if not isinstance(given, str):
            return
        if kind == "function_call":
            k = self.opened
            if self.part.reopened(k) and k < len(self.shown.calls):
                item_id, call_id = self.shown.calls[k]
                self.ids[given] = item_id
                if isinstance(item.get("call_id"), str) and isinstance(call_id, str):
                    self.ids[item["call_id"]] = call_id
            return
        had = self.shown.kinds.get("reasoning" if kind == "reasoning" else "text")
        if isinstance(had, str):
            self.ids[given] = had


class Responses(TypedApi):
    name = "responses"
    paths = ("/v1/responses", "/responses")
    reading = _Reader
    seeded = True
    timed = True

    def error_event(self, status: int, message: str, kind: str) -> bytes:
        """The Responses API's `error` event (type, code, message, param), which also carries OpenAI's `error` object:
        the openai SDK raises on a stream event that has one, as it does on llama-server's own stream errors."""
        code = "server_error" if status >= 500 else kind
        return self.event({"type": "error", "code": code, "message": message, "param": None,
                           **error_body(status, message, kind)})

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        response = payload.get("response") if payload.get("type") == "response.completed" else None
        usage = response.get("usage") if isinstance(response, dict) else None
        if not isinstance(usage, dict):
            return False
        prompt, generated = carry.counts(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0))
        usage.update(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
        return True

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        body = copy.deepcopy(request)
        body["input"] = _input(body.get("input"), text, reasoning)
        return body


def _input(given: Any, text: str, reasoning: str) -> list[Any]:
    """A request's `input` that goes on from an answer's text and reasoning: its items, then the answer as a
    reasoning item and an assistant message. An assistant message or reasoning the input ended with (a prefill) is
    the answer's start: the answer, as llama-server streamed it, holds it."""
    items: list[Any] = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    while items and isinstance(items[-1], dict) and (items[-1].get("type") == "reasoning" or (
            items[-1].get("type") == "message" and items[-1].get("role") == "assistant")):
        items.pop()
    if reasoning:
        items.append({"type": "reasoning", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}]})
    if text or not reasoning:
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
    return items
