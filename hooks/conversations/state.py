"""The conversation cache's state for the wrapper's life (it outlives generations: a reload keeps it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from hooks.conversations.isolation import PublicPrefix
from hooks.conversations.rates import KeptRates
from hooks.conversations.settings import CACHE
from hooks.decisions import Decisions
from hooks.slots.book import SlotBook, book_of
from hooks.slots.stores import store_of
from wrapper.kept import Key
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaError

FAMILY = "conversations"


@dataclass
class Leases:
    """Which slots a request or a move of ours holds now (a pinned request, a save, a cut), which ones requests the
    server placed itself were seen in, and when each was last used: the one lease every step, checkpoint and forget
    takes a slot through."""

    busy: set[int] = field(default_factory=set)  # slots held by a request or a move of ours
    placed: set[int] = field(default_factory=set)  # the slots requests the server placed itself were seen in
    background: dict[int, bool] = field(default_factory=dict)  # slot -> whether its last request was an agent's
    last_used: dict[int, float] = field(default_factory=dict)
    keeping: set[int] = field(default_factory=set)  # of the busy ones, those a checkpoint saves right after an answer
    serving: dict[int, str | None] = field(default_factory=dict)  # of the busy ones, those a request holds: whose
    # request it is (its consumer; None: nobody's)
    _freed: asyncio.Event = field(default_factory=asyncio.Event)  # set when a slot is let go

    def free(self, slot: int) -> bool:
        return slot not in self.busy

    def take(self, slot: int) -> None:
        self.busy.add(slot)

    def serve(self, slot: int, consumer: str | None) -> None:
        """A request of `consumer`'s takes the slot."""
        self.take(slot)
        self.serving[slot] = consumer

    def let_go(self, slot: int, used: bool = True) -> None:
        """The slot is free for another request or move of ours; `used`: a request ran there (the checkpoints'
        quiet moment counts from now)."""
        self.busy.discard(slot)
        self.serving.pop(slot, None)
        if used:
            self.last_used[slot] = time.monotonic()
        self._freed.set()

    def used(self, *slots: int) -> None:
        now = time.monotonic()
        self.last_used.update({slot: now for slot in slots})
        self._freed.set()

    @contextlib.asynccontextmanager
    async def holding(self, slot: int) -> AsyncIterator[None]:
        """A move's hold on a free slot (a save, a cut, an erase): requests wait for it; it is not a use."""
        self.take(slot)
        try:
            yield
        finally:
            self.let_go(slot, used=False)

    async def until_freed(self, timeout: float) -> None:
        """Until a slot is let go, or `timeout` seconds."""
        self._freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), timeout=timeout)

    async def until_kept(self, timeout: float) -> None:
        """Until no checkpoint holds a slot (a save holds the server's loop anyway), `timeout` seconds at most: a
        request that goes on from a slot being kept waits for it rather than go elsewhere."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self.keeping and (left := until - loop.time()) > 0:
            await self.until_freed(left)

    def quiet_for(self) -> float:
        """Seconds since a request last used a slot."""
        return time.monotonic() - max(self.last_used.values(), default=0.0)


@dataclass
class Conversations:
    kept: KeptRates | None = None  # loaded at the first use (the model id is known then)
    leases: Leases = field(default_factory=Leases)
    unpinned: int = 0  # requests in flight in a slot the server chose (Responses, Messages, infill, embeddings)
    placing: int = 0  # of those, the ones whose slot is not known yet (pinned requests wait for it, a while)
    settling: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as each of them is placed
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # its own, referenced until they end: the polls
    # that look for a placed request's slot, the checkpoints right after an answer
    decisions: Decisions = field(default_factory=Decisions)
    written: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=10_000))
    hits: int = 0
    hits_by_entry: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    retry_at: dict[int, float] = field(default_factory=dict)  # slot -> when a checkpoint tries it again (its save
    # failed: the disk, the server)
    continued: int = 0  # requests that went on in the slot holding their conversation (no lookup)
    checkpoints: dict[str, int] = field(default_factory=lambda: {"idle": 0, "busy": 0})
    stall_s: float = 0.0  # the seconds busy checkpoints held the server's loop
    purged: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))  # slots llama-server erased
    # itself to make room (its log said so): a loss the wrapper did not prevent
    kv_per_token: float | None = None  # bytes a token's KV takes in a state file, from the last save or restore
    busy_checkpoint_at: float = 0.0  # (monotonic) the next busy checkpoint may start then (`cache.checkpoint_share`)
    public: PublicPrefix = field(default_factory=PublicPrefix)  # consumers.shared_prefix's tokens, once learnt
    forgotten: dict[str, float] = field(default_factory=dict)  # consumer -> the forget whose slots were cleared

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run `work` as a task of its own, referenced until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

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


async def counted(generation: Generation) -> SlotBook:
    """The book, once it knows how many slots the server runs (asked at a new server's first need of it: its start
    may have restored conversations into them)."""
    book = book_of(generation)
    if not book.total:
        with contextlib.suppress(LlamaError):
            book.learnt_total(int((await generation.props()).get("total_slots") or 1))
    return book
