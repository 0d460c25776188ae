"""A chat request's conversation told by its messages, without its chat template or its tokens: the number of
messages a slot's last request had and a digest of them (after a digest of the other fields the template reads).
A request whose first messages have that digest continues the conversation that slot holds (step.py's
`continuing`): it goes there, and nothing of its history is templated or tokenized again. An edited earlier
message, other tools or other template arguments give another digest, and the request takes the whole lookup."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

TEMPLATE_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs",
                   "reasoning_format", "add_generation_prompt", "continue_final_message")
"""What llama-server's chat template is given besides the messages (a change of any of them may change the text
of the whole history)."""


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(json.dumps(value, default=str).encode(), digest_size=16).digest()


@dataclass(frozen=True)
class Chain:
    """What a slot's last request was: its template fields, its number of messages and their digest."""

    seed: bytes
    count: int
    digest: bytes


@dataclass
class Messages:
    """A chat request's messages, digested only as far as a slot's chain asks (one digest per length)."""

    seed: bytes
    messages: list[Any]
    _digests: dict[int, bytes] = field(default_factory=dict)

    def digest(self, count: int) -> bytes:
        if count not in self._digests:
            self._digests[count] = _digest(self.messages[:count])
        return self._digests[count]

    def continues(self, held: Chain) -> bool:
        """Whether this request goes on from `held`'s (its messages first, the same template fields)."""
        return self.seed == held.seed and held.count <= len(self.messages) and self.digest(held.count) == held.digest

    def chain(self) -> Chain:
        """This request's chain, for the slot it is answered in."""
        return Chain(self.seed, len(self.messages), self.digest(len(self.messages)))


def messages_of(payload: dict[str, Any]) -> Messages | None:
    """A chat request's messages; None when it has no list of them."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    return Messages(_digest([payload.get(key) for key in TEMPLATE_FIELDS]), messages)
