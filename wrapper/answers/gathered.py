"""A background request that asked for one JSON answer is sent to llama-server as a stream, so that it can be
paused (llama-server stops a generation only when a stream's client goes away); its events are gathered here and
the client gets the one answer llama-server would have given, its parts joined when it was paused and resumed.
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.continuation import SoFar
from wrapper.answers.sse import Events, Had


class Gathered(Events):
    """One pass's events, none passed on: read as they come (what they carry: wrapper/answers/sse.py), and the first
    event's identity."""

    def __init__(self, chat: bool, skip: str = "", again: int = 0, had: Had | None = None) -> None:
        super().__init__(chat, skip=skip, continuing=bool(skip or again or had), holds=False, again=again, had=had)
        self._fast = False  # read as they come: nothing goes to the client, the answer is made of them
        self.first: dict[str, Any] | None = None

    def _chat(self, raw: bytes, payload: dict[str, Any]) -> bytes | None:
        if self.first is None:
            self.first = payload
        return super()._chat(raw, payload)


def whole_answer(path_is_chat: bool, last: Gathered, so_far: SoFar, prompt: int | None,
                 original: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer of a request whose passes were gathered: what every pass gave (`so_far`: the text, the
    reasoning, the tool calls, the tokens), the rest from the last one (`prompt`: the request's own prompt tokens,
    when known; `timings` are the last pass's)."""
    text, generated = so_far.text, so_far.tokens
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
    if so_far.reasoning:
        message["reasoning_content"] = "".join(so_far.reasoning)
    if so_far.calls:
        message["tool_calls"] = [{"type": "function", **({"id": call[0]} if call[0] else {}),
                                  "function": {"name": call[1], "arguments": call[2]}}
                                 for _, call in sorted(so_far.calls.items())]
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
