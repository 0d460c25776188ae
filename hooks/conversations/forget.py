"""Forget a consumer (`DELETE /wrapper/conversations`): its slots cleared, its entries gone from the folder and the
bucket with the chunks no other entry names, and a tombstone on the bucket so that every other host does the same
— also with the slots there that hold its conversations (`follow`, from the conversation cache's idle loop)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from hooks.conversations.moves import erase_forgotten
from hooks.conversations.state import Conversations, counted, enabled, state
from hooks.slots.book import book_of
from hooks.slots.stores import store_of
from hooks.store.bucket import BucketError
from wrapper.configuration import consumers
from wrapper.configuration.consumers import CONSUMERS
from wrapper.server.generation import Generation, Host
from wrapper.server.llama import LlamaError

log = structlog.get_logger()

ERASE_RETRY_S = 1.0  # a slot the server would not erase is tried again this long after


async def forget(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The route's handler: `body["consumer"]`, the name the endpoint resolved from the key (or the admin's ask)."""
    generation = host.current
    consumer = str(body.get("consumer") or "")
    if (refusal := unanswerable(generation, consumer)) is not None:
        return refusal
    store = store_of(generation)
    assert store is not None
    began = time.monotonic()
    cleared, in_flight = await clear_slots(generation, state(generation), consumer, time.time())
    answer: dict[str, Any] = {"consumer": consumer, "slots": cleared, "in_flight": in_flight}
    try:
        answer.update(await store.forget_consumer(consumer))
        state(generation).forgotten[consumer] = store.forgotten().get(consumer, time.time())  # cleared above
    except (BucketError, OSError) as exc:
        log.warning("consumers.forget_incomplete", consumer=consumer, error=str(exc))
        answer["error"] = f"the bucket could not be told ({exc}): ask again once it answers"
        return 503, answer
    answer["s"] = round(time.monotonic() - began, 3)
    log.info("consumers.forgotten", **answer)
    return 200, answer


def unanswerable(generation: Generation, consumer: str) -> tuple[int, dict[str, Any]] | None:
    """Why an ask about one consumer's conversations (listed, forgotten) cannot be answered: a consumer no request
    may be (404), or no conversation cache (409); None: it can."""
    if not consumers.known(CONSUMERS.of(generation.config), consumer):
        return 404, {"error": {"code": 404, "message": f"no consumer named {consumer!r}", "type": "not_found_error"}}
    if not enabled(generation) or store_of(generation) is None:
        return 409, {"error": {"code": 409, "message": "the conversation cache is off: nothing is kept",
                               "type": "conflict"}}
    return None


async def clear_slots(generation: Generation, conv: Conversations, consumer: str, before: float) -> tuple[
        list[int], list[int]]:
    """Erase every slot holding that consumer's conversation (or one nobody can say whose it is), last used before
    `before` (the wall time of the forget); a slot a request of ours still runs in is never saved from now on and is
    erased once that request ends, before any other takes it (`erase_when_free`). The slots cleared, and those still
    in flight."""
    if not generation.alive:
        return [], []  # asleep: what its slots held is in the store, forgotten there
    book = await counted(generation)  # just started: its restore may have put that consumer's states in slots
    since = before - time.time() + time.monotonic()  # in the clock of `last_used`

    leases = conv.leases

    def theirs(slot: int) -> bool:
        owner = book.owner_of(slot)  # what it held before the request running there, if any
        return not book.empty(slot) and (owner is None or consumers.name_of(owner) == consumer) and \
            leases.last_used.get(slot, 0.0) <= since

    def running_theirs(slot: int) -> bool:
        """A busy slot: a request of theirs runs there, or a move of ours (a save, a cut) holds theirs."""
        if slot in leases.serving:
            running = leases.serving[slot]
            return running is not None and consumers.name_of(running) == consumer
        return theirs(slot)

    cleared, in_flight = [], []
    for slot in range(book.total):
        if book.to_erase(slot):
            continue
        if not leases.free(slot):
            if running_theirs(slot):  # (another's request there leaves its own conversation)
                book.erase_later(slot)  # a save under way there commits nothing (the store refuses it), none starts
                conv.spawn(erase_when_free(generation, conv, slot, consumer))
                in_flight.append(slot)
            continue
        if theirs(slot) and await _erased(generation, conv, slot):
            cleared.append(slot)
    return cleared, in_flight


async def _erased(generation: Generation, conv: Conversations, slot: int) -> bool:
    """Erase the free slot, holding its lease meanwhile; whether the server did (else it is said why)."""
    async with conv.leases.holding(slot):
        try:
            await erase_forgotten(generation, slot)
        except LlamaError as exc:
            log.warning("consumers.slot_not_cleared", slot=slot, error=str(exc))
            return False
    return True


async def erase_when_free(generation: Generation, conv: Conversations, slot: int, consumer: str) -> None:
    """Erase a forgotten conversation's slot once the request running there lets it go (no request of ours takes a
    slot `to_erase`), for as long as its server lives (a new one does not hold it)."""
    book, leases = book_of(generation), conv.leases
    while book.to_erase(slot) and generation.alive:
        if not leases.free(slot):
            await leases.until_freed(5.0)
            continue
        if await _erased(generation, conv, slot):
            log.info("consumers.slots_cleared", consumer=consumer, slots=[slot], after="its request")
            return
        await asyncio.sleep(ERASE_RETRY_S)


async def follow(generation: Generation) -> None:
    """Another host forgot a consumer (its tombstone read at the store's last look): the slots here that hold its
    conversations from before then are cleared too."""
    store = store_of(generation)
    if store is None:
        return
    conv = state(generation)
    for consumer, at in store.forgotten().items():
        if conv.forgotten.get(consumer, 0.0) >= at:
            continue
        conv.forgotten[consumer] = at
        cleared, _ = await clear_slots(generation, conv, consumer, at)
        if cleared:
            log.info("consumers.slots_cleared", consumer=consumer, slots=cleared)
