"""The conversation cache's state for the wrapper's life (it outlives generations: a reload keeps it)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from hooks.conversations.isolation import PublicPrefix
from hooks.conversations.rates import KeptRates
from hooks.conversations.settings import CACHE
from hooks.decisions import Decisions
from hooks.slots.book import SlotBook
from hooks.slots.stores import store_of
from hooks.store import common_prefix
from wrapper.kept import Key
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation

FAMILY = "conversations"


@dataclass
class Conversations:
    kept: KeptRates | None = None  # loaded at the first use (the model id is known then)
    busy: set[int] = field(default_factory=set)  # slots with a request of ours in flight
    unpinned: int = 0  # requests in flight in a slot the server chose (Responses, Messages, infill, embeddings)
    background: dict[int, bool] = field(default_factory=dict)  # slot -> whether its last request was an agent's
    placing: int = 0  # of those, the ones whose slot is not known yet (pinned requests wait for it, a while)
    settling: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as each of them is placed
    placed: set[int] = field(default_factory=set)  # the slots such requests were seen in, while they run
    finding: set[asyncio.Task[None]] = field(default_factory=set)  # the polls that look for them
    last_used: dict[int, float] = field(default_factory=dict)
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # set when one of our requests ends
    decisions: Decisions = field(default_factory=Decisions)
    written: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=10_000))
    hits: int = 0
    hits_by_entry: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    kept_as: dict[int, tuple[list[int], int]] = field(default_factory=dict)  # slot -> (its prompt, the tokens it
    # held) when it was last kept (checkpoints)
    retry_at: dict[int, float] = field(default_factory=dict)  # slot -> when a checkpoint tries it again (its save
    # failed: the disk, the server)
    continued: int = 0  # requests that went on in the slot holding their conversation (no lookup)
    public: PublicPrefix = field(default_factory=PublicPrefix)  # consumers.shared_prefix's tokens, once learnt
    forgotten: dict[str, float] = field(default_factory=dict)  # consumer -> the forget whose slots were cleared

    def rates_of(self, generation: Generation) -> KeptRates:
        if self.kept is None:
            self.kept = KeptRates(generation.launch.model.id)
        return self.kept

    def bytes_written(self, within: float | None = None) -> int:
        since = time.time() - within if within is not None else 0.0
        return sum(n for at, n in self.written if at >= since)

    def miss(self, reason: str, consumer: str | None = None) -> None:
        self.misses[reason] = self.misses.get(reason, 0) + 1
        METRICS.conv_lookups.labels(result="miss", reason=LABELS.get(reason, "other")).inc()
        METRICS.looked_up(consumer, hit=False)

    def hit(self, key: str, at_start: bool = False, consumer: str | None = None) -> None:
        """A lookup answered from the store: restored now, or (`at_start`) what the start restored into the slot."""
        METRICS.looked_up(consumer, hit=True)
        self.hits += 1
        self.hits_by_entry[key] = self.hits_by_entry.get(key, 0) + 1
        METRICS.conv_lookups.labels(result="hit", reason="restored_at_start" if at_start else "restored").inc()


LABELS = {"not cached": "not_cached", "the slot holds as much": "in_slot", "too little to win": "too_little",
          "a prefill is quicker": "prefill_quicker", "the server refused it": "refused", "not usable": "unusable",
          "the server died restoring it": "server_died"}
"""The `reason` label of a miss in /metrics, for the reason status gives in words."""


STATE = Key("conversations", Conversations)  # for the wrapper's life: the rates, the hits, the pins


def state(generation: Generation) -> Conversations:
    return generation.shared.get(STATE)


def enabled(generation: Generation) -> bool:
    return CACHE.of(generation.config).enabled and store_of(generation) is not None


def grown(kept_as: tuple[list[int], int] | None, prompt: list[int], held: int) -> int:
    """How much a slot holding `held` tokens for `prompt` grew since it was kept as `kept_as` (its prompt then,
    the tokens it held then): from what it held when this conversation goes on from that one, else from what
    the two share (another conversation took the slot)."""
    if kept_as is None:
        return held
    kept_prompt, kept_held = kept_as
    shared = common_prefix(kept_prompt, prompt)
    return held - (kept_held if shared == len(kept_prompt) else shared)


def unkept(conv: Conversations, book: SlotBook) -> dict[int, int]:
    """Each slot's tokens the store does not keep: what a crash now would prefill again (0: its conversation is
    kept as it stands, restored unchanged or saved since it last grew). Untracked slots are not counted
    (`SlotBook.untracked`: what they hold is not known)."""
    return {slot: 0 if book.entry_of(slot) is not None or book.restored_unchanged(slot) else
            max(0, grown(conv.kept_as.get(slot), tokens, book.count(slot))) for slot, tokens in book.known().items()}

