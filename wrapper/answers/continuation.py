"""Where an answer goes on from: what its client has so far, and the request that goes on from it — after a loss of
the server, a pause, or a growth of the context (the answer's API says how: wrapper/answers/apis/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wrapper.answers.apis.api import Api, less
from wrapper.answers.part import Call, Had, Part

RANDOM_SEED = 0xFFFFFFFF  # llama-server's seed that asks for a random one
RESUME_LOOKBACK = 16  # how many of an answer's last tokens a resume may generate again


def greedy(request: dict[str, Any]) -> bool:
    """Whether the request samples nothing (temperature 0 or less, or top_k 1): generating a token again gives the
    same token."""
    temperature, top_k = request.get("temperature"), request.get("top_k")
    return (isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature <= 0) or \
        (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k == 1)


def repeatable(request: dict[str, Any], api: Api) -> bool:
    """Whether an answer to `request` generated again from the start is the answer it was: it samples nothing
    (greedy), or samples from a seed the API passes on to llama-server (the client's, or the wrapper's own:
    wrapper/answers/answer.py) — not a Messages request, whose `seed` llama-server drops."""
    seed = request.get("seed")
    return greedy(request) or (api.seeded and isinstance(seed, int) and not isinstance(seed, bool)
                               and 0 <= seed < RANDOM_SEED)


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
    """The answer a client has so far, a piece per token: its text, and an assistant message's reasoning and tool
    calls; and the request that goes on from it."""

    api: Api
    pieces: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, Call] = field(default_factory=dict)
    call_tokens: int = 0  # events that carried a tool call's part
    generated: int | None = None  # the tokens generated for all of it, as llama-server counted them (None: unknown)
    counted_from: int | None = 0  # ... before the part under way: what its prefill holds (None: not counted)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def thought(self) -> str:
        return "".join(self.reasoning)

    @property
    def tokens(self) -> int:
        return len(self.pieces) + len(self.reasoning) + self.call_tokens

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls as a chat message carries them."""
        return [{"type": "function", **({"id": call.id} if call.id else {}),
                 "function": {"name": call.name, "arguments": call.arguments}}
                for _, call in sorted(self.calls.items())]

    def took(self, part: Part) -> None:
        """What one part of the answer gave its client."""
        self.pieces += part.content
        self.reasoning += part.reasoning
        for k, call in part.calls.items():
            had = self.calls.setdefault(k, Call())
            had.id = had.id or call.id
            had.name = had.name or call.name
            had.arguments += call.arguments
        self.call_tokens += part.call_tokens
        if part.decoded is not None and self.counted_from is not None:
            self.generated = self.counted_from + part.decoded
        else:
            self.generated = None

    def going_on(self, request: dict[str, Any], again: bool) -> tuple[dict[str, Any], Had]:
        """The request that goes on after a pause or a loss, and what of its events the client has (`again`: the
        request is greedy, and goes on from before the last word, see resume_point). Nothing is shown twice.

        - An answer whose API cannot go on from a prefix (infill) is generated again from the start.
        - One whose tool call began is generated again from the start (a trailing assistant message may not carry
          tool calls, and a model given only the text before a call may not make it again): the client is shown
          only what it lacks, the call under the id and name it has. The wrapper made the request's sampling
          repeatable (a seed of its own: wrapper/answers/answer.py), so it comes again as it was.
        - One whose text has not begun goes on within its reasoning."""
        api = self.api
        self.counted_from = 0  # generated again from the start, unless it goes on from a prefix (below)
        if not (self.pieces or self.reasoning or self.calls):
            return request, Had()
        if not api.exact or self.calls:
            calls = [Call(c.id, c.name, c.arguments) for _, c in sorted(self.calls.items())]
            return dict(request), Had(again=len(self.pieces), again_reasoning=len(self.reasoning), calls=calls,
                                      again_calls=self.call_tokens)
        reasoning = self.thought
        if api.message and not self.pieces:  # within its reasoning
            k = resume_point(self.reasoning) if again else len(self.reasoning)
            if k == 0:  # generated again from the start (the request as it came), none of it shown twice
                return dict(request), Had(again_reasoning=len(self.reasoning))
            thought = "".join(self.reasoning[:k])
            self.counted_from = None
            return less(api.going_on(request, "", thought), k), Had(reasoning=thought,
                                                                    again_reasoning=len(self.reasoning) - k)
        k = resume_point(self.pieces) if again else len(self.pieces)
        if k == 0 and not reasoning:  # generated again from the start (the request as it came)
            return dict(request), Had(again=len(self.pieces))
        text = "".join(self.pieces[:k])
        self.counted_from = None
        body = less(api.going_on(request, text, reasoning), k + len(self.reasoning) + self.call_tokens)
        return body, Had(text=text if api.message else "", again=len(self.pieces) - k, reasoning=reasoning)

    @property
    def generated_in_message(self) -> int | None:
        """Of the tokens llama-server counted, those of the message's text and calls (its reasoning's, a token an
        event, less); None when it did not count them."""
        return None if self.generated is None else max(0, self.generated - len(self.reasoning))

    def call_under_way(self) -> tuple[Call, str] | None:
        """The one tool call an answer was cut in, when it may go on from its arguments (wrapper/answers/calls.py):
        the call and all the arguments its client has — none generated again: after the prefill is read again
        (its KV computed another way than decoding did), a piece made again may differ, and a call's arguments
        cannot be shown in two versions. None: an API whose answer is no message, no call, or several (their
        markup between calls is the template's own: they are generated again from the start)."""
        if not (self.api.message and self.api.exact) or len(self.calls) != 1:
            return None
        (_, call), = self.calls.items()
        return (call, call.arguments) if call.name else None

    def call_going_on(self, request: dict[str, Any], prefill: str, tokens: int) -> tuple[dict[str, Any], Had]:
        """The request that goes on from a call under way: its text, the call's markup and its arguments so far as
        the assistant's `prefill` (`tokens` of it as the tokenizer counts them, less from the request's limit, so
        that it ends about where the uncut answer would); the call opens again in it and shows only what the client
        lacks."""
        calls = [Call(c.id, c.name, c.arguments) for _, c in sorted(self.calls.items())]
        self.counted_from = tokens + len(self.reasoning)
        body = less(self.api.going_on(request, prefill, self.thought), tokens + len(self.reasoning))
        return body, Had(text=self.text, reasoning=self.thought, calls=calls)

    def grown(self, request: dict[str, Any]) -> tuple[dict[str, Any], Had]:
        """After a growth of the context: the request that goes on from all of the answer, and what it echoes."""
        api, text, reasoning = self.api, self.text, self.thought
        self.counted_from = None
        return less(api.going_on(request, text, reasoning), self.tokens), \
            Had(text=text, reasoning=reasoning) if api.message else Had()
