"""Completions of a prompt: llama-server's own (`POST /completion`, `/completions`) and OpenAI's (`/v1/completions`).

Read: llama-server's own events are `data:` lines of `{"content", "stop": false}`, the last `"stop": true` with the
counts and no `[DONE]`; OpenAI's are `text_completion` chunks, the text in `choices[0].text`, the last with a
`finish_reason` and the usage, then `[DONE]`.
Goes on: the answer so far appended to the prompt (a string; a token list or a mixed one takes the text as its
last element), which llama-server reads on from what the slot holds; the stream does not echo it.
Gathered: the one JSON answer each gives to a request without `stream`.
"""

from __future__ import annotations

import copy
import re
from typing import Any, ClassVar

from wrapper.answers.apis.api import Api, Said, Verdict, identity, prompt_of, timings_of, wanted
from wrapper.answers.part import Carry, Part


class Completion(Api):
    """llama-server's own completion."""

    name = "completion"
    paths: ClassVar[tuple[str, ...]] = ("/completion", "/completions")
    growable = True
    pausable = True
    seeded = True
    final = re.compile(rb'"stop"\s*:\s*true')

    def reader(self, part: Part, frame: object | None) -> _ContentReader:
        return _ContentReader(part)

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        if payload.get("stop") is not True or not isinstance(payload.get("tokens_predicted"), int):
            return False
        payload["tokens_predicted"] += carry.earlier
        if carry.prompt_tokens is not None:
            payload["tokens_evaluated"] = carry.prompt_tokens
        if carry.prompt is not None:
            payload["prompt"] = carry.prompt
        return True

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        return with_prompt_going_on(request, text)

    def gathered(self, last: Part, said: Said, prompt_tokens: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        answer = copy.deepcopy(last.final or {})
        answer.update(content=said.text, tokens_predicted=said.tokens, stop=True)
        if prompt_tokens is not None:
            answer["tokens_evaluated"] = prompt_tokens
        if isinstance(asked.get("prompt"), str):
            answer["prompt"] = asked["prompt"]
        return answer

    def cut_by_context(self, request: dict[str, Any], answer: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
        if not answer.get("truncated") and answer.get("stop_type") != "limit":
            return None
        generated = int(answer.get("tokens_predicted") or 0)
        return wanted(request, int(answer.get("tokens_evaluated") or 0) + generated, generated, n_ctx)

    def said(self, answer: dict[str, Any]) -> tuple[str, str, int]:
        return str(answer.get("content") or ""), "", int(answer.get("tokens_predicted") or 0)

    def merged(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(second)
        out["content"] = str(first.get("content") or "") + str(second.get("content") or "")
        out["tokens_predicted"] = int(first.get("tokens_predicted") or 0) + int(second.get("tokens_predicted") or 0)
        out["tokens_evaluated"] = first.get("tokens_evaluated")
        return out

    def cannot_go_on(self, request: dict[str, Any]) -> str | None:
        return super().cannot_go_on(request) or ("choices" if _prompts(request.get("prompt")) > 1 else None)


class TextCompletion(Api):
    """OpenAI's text completion."""

    name = "text completion"
    paths = ("/v1/completions",)
    seeded = True

    def reader(self, part: Part, frame: object | None) -> _TextReader:
        return _TextReader(part)

    def carried(self, payload: dict[str, Any], carry: Carry) -> bool:
        return carry.openai(payload)

    def going_on(self, request: dict[str, Any], text: str, reasoning: str) -> dict[str, Any]:
        return with_prompt_going_on(request, text)

    def gathered(self, last: Part, said: Said, prompt_tokens: int | None, asked: dict[str, Any]) -> dict[str, Any]:
        final = last.final or {}
        first = last.first or {}
        timings = timings_of(final)
        prompt = prompt_of(prompt_tokens, said, last)
        choice = (final.get("choices") or [{}])[0]
        answer: dict[str, Any] = {
            "choices": [{"text": said.text, "index": 0, "logprobs": None,
                         "finish_reason": choice.get("finish_reason")}],
            **identity(first, final), "object": "text_completion",
            "usage": {"completion_tokens": said.tokens, "prompt_tokens": prompt, "total_tokens": prompt + said.tokens,
                      "prompt_tokens_details": {"cached_tokens": min(prompt, int(timings.get("cache_n") or 0))}}}
        if timings:
            answer["timings"] = timings
        return answer

    def cannot_go_on(self, request: dict[str, Any]) -> str | None:
        return super().cannot_go_on(request) or ("choices" if _prompts(request.get("prompt")) > 1 else None)


def with_prompt_going_on(request: dict[str, Any], text: str) -> dict[str, Any]:
    """`request` (a copy) whose prompt goes on with `text`."""
    body = copy.deepcopy(request)
    body["prompt"] = prompt_going_on(body.get("prompt", ""), text)
    return body


def prompt_going_on(prompt: Any, text: str) -> Any:
    """A prompt with `text` after it: a string joined, a token list (or a mixed one) with the text as its last
    element (llama-server tokenizes a mixed list's strings in place), a one-prompt list or a prompt object within."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return [prompt_going_on(prompt[0], text)]
    if isinstance(prompt, list):
        return [*prompt, text]
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_string"), str):
        return {**prompt, "prompt_string": prompt["prompt_string"] + text}
    return str(prompt or "") + text


def _prompts(prompt: Any) -> int:
    """How many prompts a `prompt` holds (a list of strings, of token lists or of objects is one each)."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


class _ContentReader:
    """llama-server's own events (completion, infill): `content`, and `stop: true` at the end."""

    def __init__(self, part: Part) -> None:
        self.part = part

    def read(self, payload: dict[str, Any]) -> Verdict:
        if payload.get("stop"):
            self.part.ended(payload)
            return Verdict.AS_IT_CAME
        content = payload.get("content")
        if not isinstance(content, str):
            return Verdict.AS_IT_CAME
        kept = self.part.text(content)
        if kept is None:
            return Verdict.DROPPED  # the client has it: generated again after a resume
        if kept == content:
            return Verdict.AS_IT_CAME
        payload["content"] = kept
        return Verdict.CHANGED


class _TextReader:
    """OpenAI's text completion chunks: `choices[0].text`, a `finish_reason` at the end."""

    def __init__(self, part: Part) -> None:
        self.part = part

    def read(self, payload: dict[str, Any]) -> Verdict:
        choices = payload.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return Verdict.AS_IT_CAME
        choice = choices[0]
        verdict = Verdict.AS_IT_CAME
        text = choice.get("text")
        if isinstance(text, str) and text:
            kept = self.part.text(text)
            if kept != text:
                choice["text"] = kept or ""
                verdict = Verdict.CHANGED if kept else Verdict.DROPPED
        if choice.get("finish_reason"):
            self.part.ended(payload)
            return Verdict.CHANGED if verdict is Verdict.DROPPED else verdict  # the end is never dropped
        return verdict
