"""Anthropic Messages (`POST /v1/messages`, Claude Code's API): named events (wrapper/answers/apis/typed.py).

Read: `message_start` opens it; `content_block_start` opens a thinking, a text or a `tool_use` block (its id and
name) at an index; `content_block_delta` carries text (`text_delta`), thinking (`thinking_delta`) or a call's input
(`input_json_delta`) at its block's index; `message_delta` ends it with the stop reason and the usage.
Goes on: the messages, then the answer so far as a trailing assistant message (a thinking, then a text block).
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.apis.api import Verdict
from wrapper.answers.apis.typed import Shown, TypedApi, TypedReader
from wrapper.answers.part import Carry, Part


class _Reader(TypedReader):
    def __init__(self, part: Part, shown: Shown) -> None:
        super().__init__(part, shown)
        self.blocks: dict[int, int] = {}  # this part's block indexes -> the client's

    def typed(self, kind: str, payload: dict[str, Any]) -> Verdict:
        if kind == "message_start":
            message = payload.get("message") or {}
            if self.shown.id is None:
                self.shown.id = message.get("id")
            return Verdict.DROPPED if self.part.continuing else Verdict.AS_IT_CAME
        index = payload.get("index")
        if kind == "content_block_start" and isinstance(index, int):
            return self._block_started(index, payload)
        verdict = Verdict.AS_IT_CAME
        if isinstance(index, int) and self.blocks.get(index, index) != index:
            payload["index"] = self.blocks[index]
            verdict = Verdict.CHANGED
        if kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta":
                said = self.text(delta, "text")
            elif delta.get("type") == "thinking_delta":
                said = self.thought(delta, "thinking")
            elif delta.get("type") == "input_json_delta":
                said = self.arguments(self.call_of.get(payload.get("index")), delta, "partial_json")
            else:
                said = Verdict.AS_IT_CAME
            return said if said is not Verdict.AS_IT_CAME else verdict
        if kind == "message_delta":
            self.part.ended(payload)
        return verdict

    def _block_started(self, index: int, payload: dict[str, Any]) -> Verdict:
        block = payload.get("content_block") or {}
        kind = block.get("type")
        if kind == "tool_use":
            k, new = self.call_opens(block.get("id"), str(block.get("name") or ""))
            if not new:  # made again: the client has it open
                self.blocks[index] = self.shown.calls[k]
                self.call_of[self.shown.calls[k]] = k
                return Verdict.DROPPED
            self.blocks[index] = self.shown.blocks
            self.shown.calls.append(self.shown.blocks)
            self.call_of[self.shown.blocks] = k
        else:
            key = "reasoning" if kind == "thinking" else "text"
            if key in self.shown.kinds:
                self.blocks[index] = self.shown.kinds[key]
                return Verdict.DROPPED  # the client has it open
            self.blocks[index] = self.shown.kinds[key] = self.shown.blocks
        self.shown.blocks += 1
        if self.blocks[index] == index:
            return Verdict.AS_IT_CAME
        payload["index"] = self.blocks[index]
        return Verdict.CHANGED

    def client_ids(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "message_start":
            opened = payload.get("message") or {}
            if isinstance(opened.get("id"), str) and self.shown.id is not None:
                self.ids[opened["id"]] = self.shown.id


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error types by status (its SDK raises by status; the type and message say why); else api_error."""


class Messages(TypedApi):
    name = "messages"
    paths = ("/v1/messages",)
    reading = _Reader

    def error_body(self, status: int, message: str, kind: str) -> dict[str, Any]:
        """Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
        return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}

    def error_event(self, status: int, message: str, kind: str) -> bytes:
        """Anthropic's `event: error` (its SDK raises on it; an OpenAI-shaped `data:` line it ignores)."""
        return self.event(self.error_body(status, message, kind))

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        usage = payload.get("usage") if payload.get("type") == "message_delta" else None
        if not isinstance(usage, dict) or not isinstance(usage.get("output_tokens"), int):
            return False
        usage["output_tokens"] = carry.counts(0, usage["output_tokens"])[1]
        return True

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        body = copy.deepcopy(request)
        messages: list[Any] = list(body.get("messages") or [])
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages.pop()  # a prefill: the answer, as llama-server streamed it, holds it
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text or not reasoning:
            blocks.append({"type": "text", "text": text})
        body["messages"] = [*messages, {"role": "assistant", "content": blocks}]
        return body
