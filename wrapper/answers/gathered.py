"""A background request that asked for one JSON answer is sent to llama-server as a stream, so that it can be
paused (llama-server stops a generation only when a stream's client goes away); its events are gathered here and
the client gets the one answer llama-server would have given, its parts joined when it was paused and resumed.
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.sse import Events


class Gathered(Events):
    """One pass's events, none passed on: the first event's identity, the reasoning, the tool calls, the last."""

    def __init__(self, chat: bool, skip: str = "", again: int = 0) -> None:
        super().__init__(chat, skip=skip, continuing=bool(skip or again), holds=False, again=again)
        self._fast = False  # read as they come: nothing goes to the client, the answer is made of them
        self.first: dict[str, Any] | None = None
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}

    def _chat(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        if self.first is None:
            self.first = payload
        choices = payload.get("choices")
        delta = choices[0].get("delta") if isinstance(choices, list) and len(choices) == 1 and \
            isinstance(choices[0], dict) else None
        if isinstance(delta, dict):
            if isinstance(delta.get("reasoning_content"), str):
                self.reasoning.append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._tool_call(call)
        return super()._chat(raw, payload)

    def _tool_call(self, part: dict[str, Any]) -> None:
        given = part.get("index")
        index = given if isinstance(given, int) else len(self.tool_calls)
        call = self.tool_calls.setdefault(index, {"type": "function", "function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if isinstance(part.get(key), str):
                call[key] = part[key]
        function = part.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    call["function"][key] += function[key]


def whole_answer(path_is_chat: bool, last: Gathered, text: str, generated: int, prompt: int | None,
                 original: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer of a request whose passes were gathered: `text` and `generated` of every pass, the
    rest from the last one (`prompt`: the request's own prompt tokens, when known; `timings` are the last
    pass's)."""
    final = last.final or {}
    given = final.get("timings")
    timings: dict[str, Any] = given if isinstance(given, dict) else {}
    last_prompt = int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0)
    prompt_n = prompt if prompt is not None else max(0, last_prompt - (generated - last.tokens))
    if not path_is_chat:
        answer = copy.deepcopy(final)
        answer.update(content=text, tokens_predicted=generated, stop=True)
        if prompt is not None:
            answer["tokens_evaluated"] = prompt
        if isinstance(original.get("prompt"), str):
            answer["prompt"] = original["prompt"]
        return answer
    first = last.first or {}
    choice = (final.get("choices") or [{}])[0]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if last.reasoning:
        message["reasoning_content"] = "".join(last.reasoning)
    if last.tool_calls:
        message["tool_calls"] = [last.tool_calls[i] for i in sorted(last.tool_calls)]
    answer = {"choices": [{"finish_reason": choice.get("finish_reason"), "index": 0, "message": message}],
              "created": first.get("created", final.get("created")), "model": first.get("model", final.get("model")),
              "system_fingerprint": first.get("system_fingerprint", final.get("system_fingerprint")),
              "object": "chat.completion",
              "usage": {"completion_tokens": generated, "prompt_tokens": prompt_n, "total_tokens": prompt_n + generated,
                        "prompt_tokens_details": {"cached_tokens": min(prompt_n, int(timings.get("cache_n") or 0))}},
              "id": first.get("id", final.get("id"))}
    if timings:
        answer["timings"] = timings
    return answer
