"""Requests llama-server places in a slot of its own choosing (Responses, Messages, infill, embeddings): while one
runs, a pinned request is kept off its slot (the server would queue it there, behind it); the slot it ran in is learnt
from the server's `/slots` while it runs, and when it ends only that slot holds something the book does not know
(every slot, when that was not learnt: two such requests at once, or one too short to be seen). Under isolation,
every free slot holding another consumer's conversation is kept and cut to the public beginning before it goes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from hooks.conversations.isolation import Asker, asker_of, uncached
from hooks.conversations.moves import leave, take
from hooks.conversations.policy import UNTOLD, placed_in
from hooks.conversations.state import Conversations, counted, enabled, state
from hooks.slots.book import book_of
from hooks.slots.stores import store_of
from hooks.store import common_prefix
from wrapper import paths
from wrapper.server.generation import Generation, Host
from wrapper.server.llama import LlamaError
from wrapper.steps import Outgoing, SlotUse

log = structlog.get_logger()

PLACE_POLL_S = 0.1
PLACE_TRIES = 100  # about 10 s of polls: a request still unseen then is left unknown (its end forgets every slot)


async def unpinned(host: Host, out: Outgoing) -> Outgoing:
    """The step before a request the server places itself."""
    generation = host.current
    if not enabled(generation):
        return out
    conv = state(generation)
    book = await counted(generation)  # the slots it may land in: every one is untracked when its place is not seen
    asker = await asker_of(generation, conv.public, out.asked.consumer)
    conv.unpinned += 1
    conv.placing += 1
    try:
        if asker.wary(book) and not await host.survive(lambda: clear_for(generation, conv, asker)):
            out = uncached(out, asker)  # a slot of another's was not cut: nothing may be reused
        await host.survive(lambda: keep_idle(generation, conv))
    except Exception:  # never fails the request: it is served reusing nothing of another's
        log.exception("conversations.internal_error", step="clear_for")
        out = uncached(out, asker)
    conversing = out.path in (*paths.RESPONSES, *paths.MESSAGES)
    placed = _Placed(use=out.use)
    finding = conv.spawn(_find_place(generation, conv, placed))

    def ended(status: int | None) -> None:
        if placed.done:
            return
        placed.done = True
        finding.cancel()
        _settled(conv, placed)
        conv.unpinned -= 1
        book = book_of(generation)
        leases = conv.leases
        if placed.slot is not None:
            leases.placed.discard(placed.slot)
            leases.background.pop(placed.slot, None)
            leases.used(placed.slot)  # a checkpoint waits for a quiet moment after it too
            book.served(placed.slot, None, owner=asker.consumer)  # it holds what that request left: saved before a
            # conversation takes it
            if not conversing:
                book.unkeepable(placed.slot)  # embeddings, rerank, infill: no conversation to checkpoint
        else:
            book.forgotten()
            leases.used(*book.slots())

    out.after.append(ended)
    return out


async def clear_for(generation: Generation, conv: Conversations, asker: Asker) -> bool:
    """Before a request the server places itself, under isolation: every free slot holding another consumer's
    conversation is kept and cut down to the public beginning (the server would reuse whatever prefix the slot it
    chooses holds); False when one could not be (busy: a save under way; or what it holds could not be kept), and the
    request must reuse nothing."""
    book, store = await counted(generation), store_of(generation)
    assert store is not None
    leases = conv.leases
    running = await processing(generation) | leases.placed
    whole = True
    for slot in range(book.total):
        if slot in running or not asker.foreign(book, slot):
            continue
        if not leases.free(slot):  # being saved (a checkpoint) or about to serve: not cut, so nothing may be reused
            whole = False
            continue
        async with leases.holding(slot):
            keep = asker.public[:0 if book.partial(slot) else common_prefix(book.holds(slot), asker.public)]
            whole = await take(generation, conv, store, slot, keep, "another consumer's request", asker) and whole
    return whole


async def keep_idle(generation: Generation, conv: Conversations) -> None:
    """Before a request whose prompt is not known goes where the server puts it (any idle slot, whose conversation it
    then replaces): every idle slot holding what the store does not keep is kept first (moves.leave, as if nothing of
    it were reused)."""
    book, store = book_of(generation), store_of(generation)
    assert store is not None
    leases = conv.leases
    running = await processing(generation) | leases.placed
    for slot, unkept in book.unkept().items():
        if unkept and slot not in running and leases.free(slot):
            async with leases.holding(slot):
                await leave(generation, conv, store, slot, [], "a request the server places itself")


@dataclass
class _Placed:
    """Where the server put a request of its own choosing, once seen (a steered one: where else than foretold)."""

    slot: int | None = None
    done: bool = False
    settled: bool = False  # its place is known, or will not be: pinned requests need not wait for it
    use: SlotUse | None = None  # the seat's, told the slot once seen (the status shows it)


Placement = _Placed


def _settled(conv: Conversations, placed: _Placed) -> None:
    if not placed.settled:
        placed.settled = True
        conv.placing -= 1
        conv.settling.set()
        conv.settling = asyncio.Event()


async def _find_place(generation: Generation, conv: Conversations, placed: _Placed) -> None:
    """Poll the server's `/slots` until one slot processes that no request of ours is pinned to and no other such
    request was seen in: that is where this one runs. Given up when two such slots are there at once (which is
    whose cannot be told)."""
    leases = conv.leases
    try:
        for _ in range(PLACE_TRIES):
            await asyncio.sleep(PLACE_POLL_S)
            if placed.done:
                return
            seen = placed_in(await processing(generation), leases.placed | leases.busy)
            if seen == UNTOLD:
                return
            if seen is not None and not placed.done:
                placed.slot = seen
                leases.placed.add(seen)
                if placed.use is not None:
                    placed.use.slot = seen
                return
    finally:
        _settled(conv, placed)


def steered(generation: Generation, conv: Conversations, out: Outgoing, slot: int) -> Placement:
    """A request the server places itself (Messages: it drops `id_slot`) that the step prepared in `slot` (the slot
    the server's own rule gives it: its conversation restored there, what it drops kept, room made): pinned requests
    wait until it is seen there; seen in another slot (the rule misjudged), that slot is untracked and so said."""
    placed = _Placed(use=out.use)
    conv.placing += 1
    task = conv.spawn(_watch(generation, conv, placed, slot))

    def ended(status: int | None) -> None:
        placed.done = True
        task.cancel()
        _settled(conv, placed)
        if placed.slot is not None and placed.slot != slot:
            conv.leases.placed.discard(placed.slot)
            conv.leases.used(placed.slot)
            book_of(generation).served(placed.slot, None)

    out.after.insert(0, ended)
    return placed


async def _watch(generation: Generation, conv: Conversations, placed: _Placed, slot: int) -> None:
    leases = conv.leases
    try:
        for _ in range(PLACE_TRIES):
            await asyncio.sleep(PLACE_POLL_S)
            if placed.done:
                return
            running = await processing(generation)
            if slot in running:
                return
            elsewhere = placed_in(running, leases.placed | leases.busy)
            if elsewhere not in (None, UNTOLD) and not placed.done:
                placed.slot = elsewhere
                leases.placed.add(elsewhere)
                log.warning("conversations.placed_elsewhere", slot=elsewhere, prepared=slot,
                            hint="llama-server placed a Messages request in another slot than its rule foretold: "
                                 "that slot is untracked until saved")
                return
    finally:
        _settled(conv, placed)


async def processing(generation: Generation) -> set[int]:
    """The slots the server says are busy (a request it placed itself runs there)."""
    try:
        return {int(s["id"]) for s in await generation.client.slots() if s.get("is_processing")}
    except (LlamaError, KeyError, TypeError, ValueError):
        return set()


async def settled(conv: Conversations) -> None:
    """Until every request the server places itself is placed (its slot seen, or given up), PLACE_TRIES polls at
    most: the slot it takes must not be the one a pinned request is pinned to."""
    loop = asyncio.get_running_loop()
    until = loop.time() + PLACE_POLL_S * PLACE_TRIES
    while conv.placing > 0 and (left := until - loop.time()) > 0:
        settling = conv.settling
        try:
            await asyncio.wait_for(settling.wait(), timeout=left)
        except TimeoutError:
            return
