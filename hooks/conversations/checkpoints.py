"""Conversations kept while they are still in their slots: a slot whose conversation grew by
`cache.checkpoint_tokens` since it was last kept is saved into the store again (only the chunks it added are
written) and this host's note says so — so that a llama-server that crashes between turns loses at most that growth,
and one that crashes in a turn that turn besides (`slots.restore` puts the kept states back into their slots when the
watchdog starts it again).

When: right after the answer that grew it (`after_answer`: an agent's loop sends its next turn at once and never
leaves a quiet moment), or once no request has been in flight for CHECKPOINT_IDLE_S (`keep_while_idle`). A save holds
llama-server's loop while it writes the slot (every slot's decoding waits: tens of milliseconds for a small model,
seconds for a 27B one at 32k tokens), so the checkpoints taken while the server is busy are held to
`cache.checkpoint_share` of its time: one that held the loop t seconds lets the next busy one start t / share later.
A request that goes on from a slot being kept waits for the save (the server would anyway)."""

from __future__ import annotations

import asyncio
import time

import structlog

from hooks.conversations.forget import follow
from hooks.conversations.moves import save_slot
from hooks.conversations.settings import CACHE
from hooks.conversations.state import Conversations, enabled, state
from hooks.slots.book import book_of
from hooks.slots.stores import store_of
from hooks.store import Store, layout
from wrapper.configuration import consumers
from wrapper.configuration.consumers import CONSUMERS
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation, Host

log = structlog.get_logger()

CHECKPOINT_IDLE_S = 2.0
LOOK_EVERY_S = 0.5
RETRY_S = 30.0  # a slot whose save failed (the disk, the server) is tried again after this long


async def keep_while_idle(host: Host) -> None:
    """From ready until the stop."""
    while True:
        await asyncio.sleep(LOOK_EVERY_S)
        generation = host.current
        if enabled(generation) and generation.alive:
            try:
                await follow(generation)  # a consumer another host forgot: its slots here too
            except Exception:  # a bug here must not end the checkpoints for the wrapper's life
                log.exception("consumers.follow_failed")
        every = CACHE.of(generation.config).checkpoint_tokens
        if not every or not enabled(generation) or host.in_flight or not generation.alive:
            continue
        conv = state(generation)
        if conv.leases.busy or conv.leases.quiet_for() < CHECKPOINT_IDLE_S:
            continue
        store = store_of(generation)
        if store is None:
            continue
        try:
            await _keep_grown(host, generation, conv, store, every)
        except Exception:  # a bug here must not end the checkpoints for the wrapper's life
            log.exception("conversations.checkpoint_failed")


async def _keep_grown(host: Host, generation: Generation, conv: Conversations, store: Store, every: int) -> None:
    """Each slot whose conversation grew by `every` since it was kept, then each slot whose contents the book lost
    track of (a Messages or Responses request, placed by the server: only a save can tell what it holds). A slot
    whose save failed is tried again after RETRY_S."""
    book = book_of(generation)
    now = time.monotonic()
    known = book.known()
    for slot, growth in book.unkept().items():
        if growth < every or conv.retry_at.get(slot, 0.0) > now:
            continue  # kept as it stands or not grown enough, or its last save failed a moment ago
        if await _keep(host, generation, conv, store, slot, known[slot], growth) is None:
            return  # a request came: it goes first
    isolating = consumers.isolating(CONSUMERS.of(generation.config))
    for slot in book.untracked():
        if not conv.leases.free(slot) or conv.retry_at.get(slot, 0.0) > now \
                or (isolating and book.owner_of(slot) is None):
            continue  # whose it holds is not known: kept as nobody's, no lookup under isolation could use it
        if await _keep(host, generation, conv, store, slot, None, None) is None:
            return


def after_answer(host: Host, generation: Generation, conv: Conversations, store: Store, slot: int) -> None:
    """An answer just ended in `slot`, its lease let go: keep the slot now, without waiting for quiet, when it grew by
    `cache.checkpoint_tokens` since it was last kept and `cache.checkpoint_share` allows. The lease is taken here, at
    once, so that the conversation's next turn waits for the save instead of going elsewhere."""
    settings = CACHE.of(generation.config)
    now = time.monotonic()
    if not settings.checkpoint_tokens or not settings.checkpoint_share or now < conv.busy_checkpoint_at \
            or conv.retry_at.get(slot, 0.0) > now or not conv.leases.free(slot) or host.current is not generation \
            or not generation.alive:
        return
    book = book_of(generation)
    growth = book.unkept().get(slot, 0)
    if growth < settings.checkpoint_tokens:
        return
    conv.leases.take(slot)
    conv.leases.keeping.add(slot)
    conv.busy_checkpoint_at = float("inf")  # one at a time: the budget is set once this one is measured
    conv.spawn(_busy(host, generation, conv, store, slot, book.holds(slot), growth, settings.checkpoint_share))


async def _busy(host: Host, generation: Generation, conv: Conversations, store: Store, slot: int,
                prompt: list[int], growth: int, share: float) -> None:
    stall = 0.0
    try:
        stall = await _keep(host, generation, conv, store, slot, prompt, growth, busy=True) or 0.0
    except Exception:  # a bug here must never reach the request that ended
        log.exception("conversations.checkpoint_failed", slot=slot)
    finally:
        conv.leases.keeping.discard(slot)
        conv.leases.let_go(slot, used=False)
        conv.busy_checkpoint_at = time.monotonic() + stall / share


async def _keep(host: Host, generation: Generation, conv: Conversations, store: Store, slot: int,
                prompt: list[int] | None, growth: int | None, busy: bool = False) -> float | None:
    """Save the slot as a checkpoint and note it (what a restart's slots.restore puts back): the seconds the server's
    loop spent on it; None when a request came first (idle) or nothing was kept. `prompt`: the tokens the book knows
    it holds; None for an untracked slot (what the save finds there: too little, and it is not tried again until it
    serves again). `busy`: right after an answer, the lease already taken."""
    if not busy and (host.in_flight or host.current is not generation):
        return None
    book = book_of(generation)
    before = book.changes(slot)
    began = time.monotonic()
    if busy:
        saved = await save_slot(generation, conv, store, slot, "checkpoint")
    else:
        async with conv.leases.holding(slot):  # a request for this slot waits for the save (the server is busy too)
            saved = await save_slot(generation, conv, store, slot, "checkpoint")
    took = saved.server_ms / 1000 if saved is not None and saved.server_ms is not None else \
        time.monotonic() - began
    if book.changes(slot) != before:
        return took  # a request the server placed there ran meanwhile: the next quiet moment keeps what it left
    if saved is None:
        if prompt is not None or slot in book.untracked():  # the save failed or was skipped (logged): again later
            conv.retry_at[slot] = time.monotonic() + RETRY_S
        return took
    conv.retry_at.pop(slot, None)
    entry = saved.entry
    book.kept(slot, prompt if prompt is not None else book.holds(slot), entry.n_tokens)
    store.note(layout.host_id(), {slot: entry})  # what a restart's slots.restore puts back
    when = "busy" if busy else "idle"
    conv.checkpoints[when] += 1
    METRICS.conv_checkpoints.labels(when=when).inc()
    if busy:
        conv.stall_s += took
        METRICS.conv_checkpoint_stall.inc(took)
    log.info("conversations.checkpoint", slot=slot, tokens=entry.n_tokens, grown=growth,
             written=entry.written if saved.new else 0, ms=round((time.monotonic() - began) * 1000, 1),
             **({"untracked": True} if prompt is None else {}), **({"busy": True} if busy else {}))
    return took
