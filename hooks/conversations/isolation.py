"""Each consumer's conversations are its own (`consumers.isolate`): who a request is, what of the slots and the store
it may be served from, and what a request that may not be pinned is told (to reuse nothing).

llama-server reuses whatever prefix a slot holds, whoever put it there, and answers faster for it: served from
another's slot, folder or bucket entry, a request's first token would tell its sender what the other asked. So under
isolation a request is pinned only where what the slot holds beyond the public beginning is its own consumer's (or is
cut first: kept, then cut down to that beginning by hooks/conversations/moves.py's `take`), and brought back only from
its own consumer's entries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import structlog

from hooks.slots.book import SlotBook
from hooks.store import Entry, common_prefix, owner_of
from wrapper.configuration import consumers
from wrapper.configuration.consumers import CONSUMERS
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaError
from wrapper.steps import Outgoing

log = structlog.get_logger()

PUBLIC = ""  # the owner of a slot cut down to the public beginning: any consumer's request may go on from it


@dataclass(frozen=True)
class Asker:
    """Who a request is (None: consumers not configured), and what of the others' it may reuse."""

    consumer: str | None = None
    isolated: bool = False
    public: list[int] = field(default_factory=list)  # the public beginning's tokens (`consumers.shared_prefix`)

    @property
    def name(self) -> str | None:
        """The consumer it is counted as (its `cache_salt` left out)."""
        return consumers.name_of(self.consumer) if self.consumer is not None else None

    def mine(self, owner: str | None) -> bool:
        """Whether a slot holding `owner`'s conversation may serve this request beyond the public beginning (one of a
        `cache_salt` only its own salt's, isolated or not)."""
        if consumers.is_salted(owner):
            return owner == self.consumer
        return not self.isolated or owner == PUBLIC or (owner is not None and owner == self.consumer)

    def sees(self, entry: Entry) -> bool:
        """Whether a lookup for this request may bring `entry` back."""
        owner = owner_of(entry.record)
        if consumers.is_salted(owner):
            return owner == self.consumer
        return not self.isolated or (self.consumer is not None and owner == self.consumer)

    def reach(self, tokens: list[int]) -> int:
        """How much of `tokens` is the public beginning (what another consumer's slot may give it)."""
        return common_prefix(tokens, self.public) if self.public else 0

    def foreign(self, book: SlotBook, slot: int) -> bool:
        """Whether the slot holds something this request may not reuse past the public beginning."""
        return not book.empty(slot) and not self.mine(book.owner_of(slot))

    def wary(self, book: SlotBook) -> bool:
        """Whether a request the server places itself must first find no slot of another's (under isolation, or
        beside a `cache_salt`'s conversation)."""
        return self.isolated or any(self.foreign(book, slot) for slot in range(book.total))


NOBODY = Asker()  # consumers not configured


@dataclass
class PublicPrefix:
    """The public beginning's tokens, learnt once per model (the chat template decides them)."""

    model: str | None = None
    tokens: list[int] = field(default_factory=list)


async def asker_of(generation: Generation, public: PublicPrefix, consumer: str | None) -> Asker:
    settings = CONSUMERS.of(generation.config)
    if consumer is None or not (consumers.isolating(settings) or consumers.is_salted(consumer)):
        return Asker(consumer)
    model = generation.launch.model.id
    if settings.shared_prefix is not None and public.model != model:
        try:
            public.tokens = await _tokens_of(generation, json.loads(settings.shared_prefix))
        except (LlamaError, KeyError, TypeError, ValueError) as exc:
            log.warning("consumers.shared_prefix_unread", error=str(exc),
                        hint="no beginning is shared between consumers until it is read (at the next request)")
            return Asker(consumer, True)
        public.model = model
        log.info("consumers.shared_prefix", tokens=len(public.tokens))
    return Asker(consumer, True, public.tokens if settings.shared_prefix is not None else [])


async def _tokens_of(generation: Generation, prefix: dict[str, object]) -> list[int]:
    client = generation.client
    if "prompt" in prefix:
        text = str(prefix["prompt"])
    else:
        text = str((await client.call("POST", "/apply-template", prefix))["prompt"])
    tokenized = await client.call("POST", "/tokenize", {"content": text, "add_special": True, "parse_special": True})
    return [int(t) for t in tokenized["tokens"]]


def uncached(out: Outgoing, asker: Asker) -> Outgoing:
    """A request the wrapper does not pin: under isolation it is told to reuse nothing (`cache_prompt: false`), since
    the slot llama-server chooses may hold another consumer's conversation."""
    if asker.isolated and out.payload is not None:
        out.payload["cache_prompt"] = False
        out.body = json.dumps(out.payload).encode()
    return out
