"""Chat completions (`POST /v1/chat/completions`): `data:` events of `chat.completion.chunk`s and a `[DONE]`.

Read: a chunk's `delta` carries text (`content`), reasoning (`reasoning_content`) or tool calls (each by `index`;
its `id` and `name` when it opens, then `arguments` as a string diff); the chunk with a `finish_reason` ends it.
Goes on: the answer so far as a trailing assistant message (`content`, `reasoning_content`), which llama-server
continues (its stream opens again with a role chunk and a new id: dropped, and the id made the client's).
Gathered: one `chat.completion`.
"""

from __future__ import annotations

import copy
from typing import Any

from wrapper.answers.apis.api import Api, Said, Verdict, identity, prompt_of, timings_of, wanted
from wrapper.answers.part import Carry, Part


class Chat(Api):
    name = "chat"
    paths = ("/chat/completions", "/v1/chat/completions")
    message = True
    growable = True
    pausable = True
    seeded = True
    timed = True

    def reader(self, part: Part, frame: object | None) -> _Reader:
        return _Reader(part)

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        return carry.openai(payload)

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        body = copy.deepcopy(request)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        body["messages"] = [*body.get("messages", []), message]
        return body

    def gathered(self, last: Part, said: Said, prompt_tokens: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        final = last.final or {}
        first = last.first or {}
        timings = timings_of(final)
        prompt = prompt_of(prompt_tokens, said, last)
        generated = said.tokens
        choice = (final.get("choices") or [{}])[0]
        message: dict[str, Any] = {"role": "assistant", "content": said.text}
        if said.thought:
            message["reasoning_content"] = said.thought
        if said.tool_calls:
            message["tool_calls"] = said.tool_calls
        answer = {"choices": [{"finish_reason": choice.get("finish_reason"), "index": 0, "message": message}],
                  **identity(first, final), "object": "chat.completion",
                  "usage": {"completion_tokens": generated, "prompt_tokens": prompt, "total_tokens": prompt + generated,
                            "prompt_tokens_details": {"cached_tokens": min(prompt, int(timings.get("cache_n") or 0))}}}
        if timings:
            answer["timings"] = timings
        return answer

    def as_answer(self, final: dict[str, Any]) -> dict[str, Any]:
        timings = final.get("timings") or {}
        generated = int(timings.get("predicted_n") or 0)
        used = int(timings.get("cache_n") or 0) + int(timings.get("prompt_n") or 0) + generated
        usage = final.get("usage") or {"total_tokens": used, "completion_tokens": generated}
        return {"choices": [{"finish_reason": final["choices"][0].get("finish_reason"), "message": {}}],
                "usage": usage}

    def cut_by_context(self, request: dict[str, Any], answer: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
        choices = answer.get("choices")
        usage = answer.get("usage") or {}
        if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("finish_reason") != "length":
            return None
        return wanted(request, int(usage.get("total_tokens") or 0), int(usage.get("completion_tokens") or 0), n_ctx)

    def said(self, answer: dict[str, Any]) -> tuple[str, str, int]:
        message = answer["choices"][0]["message"]
        generated = int((answer.get("usage") or {}).get("completion_tokens") or 0)
        return str(message.get("content") or ""), str(message.get("reasoning_content") or ""), generated

    def merged(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(second)
        before = first["choices"][0]["message"].get("content") or ""
        after = second["choices"][0]["message"].get("content") or ""
        # llama-server answers an assistant prefix with the prefix included; other servers without it
        out["choices"][0]["message"]["content"] = after if after.startswith(before) else before + after
        usage_a, usage_b = first.get("usage") or {}, second.get("usage") or {}
        completion = int(usage_a.get("completion_tokens") or 0) + int(usage_b.get("completion_tokens") or 0)
        prompt = int(usage_a.get("prompt_tokens") or 0)
        out["usage"] = {**usage_b, "prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion}
        return out


class _Reader:
    def __init__(self, part: Part) -> None:
        self.part = part

    def read(self, payload: dict[str, Any]) -> Verdict:
        choices = payload.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return Verdict.AS_IT_CAME
        choice = choices[0]
        if choice.get("finish_reason"):
            self.part.ended(payload)
            return Verdict.AS_IT_CAME
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return Verdict.AS_IT_CAME
        part, changed = self.part, False
        thought = delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            changed |= _shown(delta, "reasoning_content", thought, part.thought(thought) or "")
        calls = delta.get("tool_calls")
        if isinstance(calls, list) and calls:
            shown = [piece for call in calls if isinstance(call, dict) and (piece := self._call(call)) is not None]
            changed |= _shown(delta, "tool_calls", calls, shown)
        content = delta.get("content")
        if isinstance(content, str) and content:
            changed |= _shown(delta, "content", content, part.text(content) or "", gone=None)
        if not changed:
            if part.continuing and "role" in delta and not content and not thought and not calls:
                return Verdict.DROPPED  # the continuation's own role chunk: the client has one
            return Verdict.AS_IT_CAME
        if not (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
            return Verdict.DROPPED  # all of it was the client's already
        if part.continuing:
            delta.pop("role", None)
        return Verdict.CHANGED

    def _call(self, piece: dict[str, Any]) -> dict[str, Any] | None:
        """One tool call's piece as the client is shown it: a call it has opened already comes again in a part after
        a loss (a new id, its name again, its arguments from the start) and is shown only what it lacks."""
        part = self.part
        index = piece.get("index")
        k = index if isinstance(index, int) else len(part.calls)
        given = piece.get("function")
        function: dict[str, Any] = given if isinstance(given, dict) else {}
        given_arguments = function.get("arguments")
        arguments = given_arguments if isinstance(given_arguments, str) else ""
        given_id, given_name = piece.get("id"), function.get("name")
        part.opened(k, given_id if isinstance(given_id, str) else None,
                    given_name if isinstance(given_name, str) else "")
        kept = part.arguments(k, arguments)
        if not part.reopened(k):
            return piece
        return {"index": k, "function": {"arguments": kept}} if kept else None


_REMOVED = object()


def _shown(delta: dict[str, Any], key: str, given: object, kept: object, gone: object = _REMOVED) -> bool:
    """`delta[key]` as the client is shown it: what it lacks of `given`, or (nothing left) `gone` — the key removed
    by default; whether it changed."""
    if kept == given:
        return False
    if kept:
        delta[key] = kept
    elif gone is _REMOVED:
        del delta[key]
    else:
        delta[key] = gone
    return True
