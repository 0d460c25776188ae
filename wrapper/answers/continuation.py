"""A generation that stopped because the context was full, continued after a growth: the partial answer goes
back as an assistant prefix (chat) or appended to the prompt (/completion), and the two answers become one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Protocol

from wrapper import paths
from wrapper.answers.sse import Had

GOES_ON_NOT = {
    "api": "its API's answers are not paused (chat completions' and /completion's are; a Responses or Messages "
           "stream goes on after a loss of the server)",
    "tools": "its request offers tools: after a pause it would not go on exactly (a tool call is made again)",
    "choices": "it asks for several choices",
}
"""Why an answer cannot go on from what its client has, by code (the priority.not_paused reason)."""


def cannot_go_on(path: str, request: dict[str, Any]) -> str | None:
    """Why an answer to `request` cannot go on after a loss of the server from what its client has (its text,
    reasoning and tool calls so far: SoFar.going_on), as a code of GOES_ON_NOT; None when it can (chat,
    Responses, Messages or /completion, one choice)."""
    if path not in paths.CONTINUABLE and path not in paths.ASSISTANT_MESSAGE:
        return "api"
    if request.get("n") not in (None, 1):
        return "choices"
    return None


def cannot_pause(path: str, request: dict[str, Any]) -> str | None:
    """Why an answer cannot be paused and go on exactly (a code of GOES_ON_NOT): as `cannot_go_on`; not a Responses
    or Messages answer (a request there cannot be pinned to the slot its state was kept in: a Messages body loses
    `id_slot`); and not one that offers tools (a tool call under way is made again from the start, which a restored
    state does not make exact)."""
    if path not in paths.CONTINUABLE:
        return "api"
    return cannot_go_on(path, request) or ("tools" if request.get("tools") else None)


LIMITS = ("max_completion_tokens", "max_tokens", "n_predict", "max_output_tokens")  # what it may generate, by API


def _limit(request: dict[str, Any]) -> int | None:
    for key in LIMITS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def cut_by_context(path: str, request: dict[str, Any], answer: dict[str, Any], n_ctx: int) -> tuple[int, int] | None:
    """(tokens used, tokens still wanted) when `answer` stopped at a full context with tokens left in the
    request's limit; None otherwise."""
    if path in paths.CHAT:
        choices = answer.get("choices")
        usage = answer.get("usage") or {}
        if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("finish_reason") != "length":
            return None
        used, generated = int(usage.get("total_tokens") or 0), int(usage.get("completion_tokens") or 0)
    elif path == paths.NATIVE_COMPLETION:
        if not answer.get("truncated") and answer.get("stop_type") != "limit":
            return None
        generated = int(answer.get("tokens_predicted") or 0)
        used = int(answer.get("tokens_evaluated") or 0) + generated
    else:
        return None
    if used < n_ctx - 1:
        return None  # the request's own limit stopped it, not the context
    limit = _limit(request)
    wanted = (limit - generated) if limit is not None else None
    if wanted is not None and wanted <= 0:
        return None
    return used, wanted if wanted is not None else 0


def continued(path: str, request: dict[str, Any], answer: dict[str, Any],
              generated: int | None = None) -> dict[str, Any]:
    """The request that goes on where `answer` stopped (`generated`: the tokens it took of the request's limit, by
    default as the answer counts them)."""
    body = copy.deepcopy(request)
    if path in paths.ASSISTANT_MESSAGE:
        said = answer["choices"][0]["message"]
        text, reasoning = str(said.get("content") or ""), str(said.get("reasoning_content") or "")
        if path in paths.RESPONSES:
            body["input"] = _responses_input(body.get("input"), text, reasoning)
        elif path in paths.MESSAGES:
            body["messages"] = _messages_messages(body.get("messages"), text, reasoning)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = reasoning
            body["messages"] = [*body.get("messages", []), message]
        counted = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    else:
        body["prompt"] = str(body.get("prompt", "")) + str(answer.get("content") or "")
        counted = int(answer.get("tokens_predicted") or 0)
    generated = counted if generated is None else generated
    for key in LIMITS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            body[key] = max(1, value - generated)
    return body


def _responses_input(given: Any, text: str, reasoning: str) -> list[Any]:
    """A Responses request's `input` that goes on from an answer's text and reasoning: its items, then the answer
    as a reasoning item and an assistant message (llama-server merges them into one assistant message, which it
    continues). An assistant message or reasoning the input ended with (a prefill) is the answer's start: the
    answer, as llama-server streamed it, holds it."""
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


def _messages_messages(given: Any, text: str, reasoning: str) -> list[Any]:
    """A Messages request's `messages` that go on from an answer's text and reasoning: a trailing assistant message
    (thinking, then text) — the one the request ended with (a prefill) replaced: the answer holds it."""
    messages: list[Any] = list(given or [])
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages.pop()
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not reasoning:
        blocks.append({"type": "text", "text": text})
    return [*messages, {"role": "assistant", "content": blocks}]


def merged(path: str, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One answer from the cut one and its continuation: text joined, token counts summed."""
    out = copy.deepcopy(second)
    if path in paths.CHAT:
        before = first["choices"][0]["message"].get("content") or ""
        after = second["choices"][0]["message"].get("content") or ""
        # llama-server answers an assistant prefix with the prefix included; other servers without it
        out["choices"][0]["message"]["content"] = after if after.startswith(before) else before + after
        usage_a, usage_b = first.get("usage") or {}, second.get("usage") or {}
        completion = int(usage_a.get("completion_tokens") or 0) + int(usage_b.get("completion_tokens") or 0)
        prompt = int(usage_a.get("prompt_tokens") or 0)
        out["usage"] = {**usage_b, "prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion}
    else:
        out["content"] = str(first.get("content") or "") + str(second.get("content") or "")
        out["tokens_predicted"] = int(first.get("tokens_predicted") or 0) + int(second.get("tokens_predicted") or 0)
        out["tokens_evaluated"] = first.get("tokens_evaluated")
    return out


RESUME_LOOKBACK = 16  # how many of an answer's last tokens a resume may generate again


def greedy(request: dict[str, Any]) -> bool:
    """Whether the request samples nothing (temperature 0 or less, or top_k 1): generating a token again gives the
    same token."""
    temperature, top_k = request.get("temperature"), request.get("top_k")
    return (isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature <= 0) or \
        (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1)


def resume_point(pieces: list[str]) -> int:
    """Where a resume goes on from: before the last token that begins a word (" word"), within the last
    RESUME_LOOKBACK tokens; else after the last one. The text before it is tokenized again as decoding made it
    (tokenizers do not merge across the space before a word), so the restored state matches it token for token;
    what follows is generated again — at temperature 0 the same text — instead of being read back in pieces the
    tokenizer may join another way (".\n\n" as two tokens or one), which changes what comes next."""
    for k in range(len(pieces) - 1, max(0, len(pieces) - RESUME_LOOKBACK) - 1, -1):
        piece = pieces[k]
        if k > 0 and len(piece) > 1 and piece[0] == " " and not piece[1].isspace():
            return k
    if len(pieces) <= RESUME_LOOKBACK:  # a start with no word begun in it ("\n", "#"): all of it comes again — read
        return 0  # back after the template's own newline, "\n" became "\n\n" and the answer degenerated
    return len(pieces)


@dataclass
class SoFar:
    """The answer a client has so far, a piece per token (its content; a chat answer's reasoning and tool calls
    too), and the request that goes on from it."""

    chat: bool
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, list[Any]] = field(default_factory=dict)  # index -> [id, name, arguments]
    call_tokens: int = 0  # events that carried a tool call's part

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        return len(self.pieces) + len(self.reasoning) + self.call_tokens

    def add(self, content: list[str]) -> None:
        self.pieces += content

    def took(self, part: Parted) -> None:
        """What one part of the answer gave its client."""
        self.pieces += part.content
        self.reasoning += part.reasoning
        for index, (call_id, name, arguments) in part.calls.items():
            had = self.calls.setdefault(index, [None, "", ""])
            had[0] = had[0] or call_id
            had[1] = had[1] or name
            had[2] += arguments
        self.call_tokens += part.call_tokens

    def shaped(self, upto: int | None = None) -> dict[str, Any]:
        """The answer (its first `upto` tokens of content) in the shape `continued` goes on from."""
        k = len(self.pieces) if upto is None else upto
        text = "".join(self.pieces[:k])
        if self.chat:
            message: dict[str, Any] = {"content": text}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            return {"choices": [{"message": message}],
                    "usage": {"completion_tokens": k + len(self.reasoning) + self.call_tokens}}
        return {"content": text, "tokens_predicted": k}

    def going_on(self, path: str, request: dict[str, Any], again: bool) -> tuple[dict[str, Any], str, int, Had]:
        """The request that goes on after a pause or a loss; the text llama-server echoes first (the assistant
        prefix of a chat); how many of the events that follow the client has already (`again`: the request is
        greedy, and goes on from before the last word, see resume_point); and what else of a chat answer the
        client has (its reasoning, its tool calls). None of those is shown again.

        A chat answer whose tool call began goes on from what came before the call, and the calls are made again
        (a trailing assistant message may not carry tool calls): the client is shown only what it lacks of them.
        One whose content has not begun goes on within its reasoning."""
        if not (self.pieces or self.reasoning or self.calls):
            return request, "", 0, Had()
        reasoning = "".join(self.reasoning)
        if self.chat and self.calls:
            calls = [(c[0], c[1], c[2]) for _, c in sorted(self.calls.items())]
            body = continued(path, request, self.shaped(), generated=self.tokens)
            return body, self.text, 0, Had(reasoning, 0, calls)
        if self.chat and not self.pieces:  # within its reasoning
            k = resume_point(self.reasoning) if again else len(self.reasoning)
            if k == 0:  # generated again from the start (the request as it came), none of it shown twice
                return dict(request), "", 0, Had("", len(self.reasoning))
            thought = "".join(self.reasoning[:k])
            body = continued(path, request, {"choices": [{"message": {"content": "", "reasoning_content": thought}}]},
                             generated=k)
            return body, "", 0, Had(thought, len(self.reasoning) - k)
        k = resume_point(self.pieces) if again else len(self.pieces)
        if k == 0 and not reasoning:  # generated again from the start (the request as it came)
            return dict(request), "", len(self.pieces), Had()
        body = continued(path, request, self.shaped(k), generated=k + len(self.reasoning) + self.call_tokens)
        return body, "".join(self.pieces[:k]) if self.chat else "", len(self.pieces) - k, Had(reasoning)


class Parted(Protocol):
    """What one part of an answer gave its client (wrapper/answers/sse.py's Events)."""

    @property
    def content(self) -> list[str]: ...

    @property
    def reasoning(self) -> list[str]: ...

    @property
    def calls(self) -> dict[int, tuple[str | None, str, str]]: ...

    @property
    def call_tokens(self) -> int: ...
