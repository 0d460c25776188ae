"""Conversations kept while they are still in their slots: a slot whose conversation grew by
`cache.checkpoint_tokens` since it was last kept is saved into the store again (only the chunks it added are
written) and this host's note says so, once no request has been in flight for CHECKPOINT_IDLE_S — so that a
llama-server that crashes between turns loses nothing, and one that crashes in a turn loses at most that turn
(`slots.restore` puts the kept states back into their slots when the watchdog starts it again).

A save blocks llama-server's loop while it writes the slot (tens of milliseconds for a small model; seconds for a
27B one at 32k tokens): waiting for a quiet moment keeps it out of a conversation's way — an agent's next turn
comes at once, a person's after reading."""

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
        if not await _keep(host, generation, conv, store, slot, known[slot], growth):
            return  # a request came: it goes first
    isolating = consumers.isolating(CONSUMERS.of(generation.config))
    for slot in book.untracked():
        if not conv.leases.free(slot) or conv.retry_at.get(slot, 0.0) > now \
                or (isolating and book.owner_of(slot) is None):
            continue  # whose it holds is not known: kept as nobody's, no lookup under isolation could use it
        if not await _keep(host, generation, conv, store, slot, None, None):
            return


async def _keep(host: Host, generation: Generation, conv: Conversations, store: Store, slot: int,
                prompt: list[int] | None, growth: int | None) -> bool:
    """Save the slot as a checkpoint and note it (what a restart's slots.restore puts back); False when a request
    came first. `prompt`: the tokens the book knows it holds; None for an untracked slot (what the save finds
    there: too little, and it is not tried again until it serves again)."""
    if host.in_flight or host.current is not generation:
        return False
    book = book_of(generation)
    before = book.changes(slot)
    began = time.monotonic()
    async with conv.leases.holding(slot):  # a request for this slot waits for the save (the server is busy anyway)
        saved = await save_slot(generation, conv, store, slot, "checkpoint")
    if book.changes(slot) != before:
        return True  # a request the server placed there ran meanwhile: the next quiet moment keeps what it left
    if saved is None:
        if prompt is not None or slot in book.untracked():  # the save failed or was skipped (logged): again later
            conv.retry_at[slot] = time.monotonic() + RETRY_S
        return True
    conv.retry_at.pop(slot, None)
    entry = saved.entry
    book.kept(slot, prompt if prompt is not None else book.holds(slot), entry.n_tokens)
    store.note(layout.host_id(), {slot: entry})  # what a restart's slots.restore puts back
    log.info("conversations.checkpoint", slot=slot, tokens=entry.n_tokens, grown=growth,
             written=entry.written if saved.new else 0, ms=round((time.monotonic() - began) * 1000, 1),
             **({"untracked": True} if prompt is None else {}))
    return True
