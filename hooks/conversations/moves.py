"""The moves of a conversation between a slot and the store, and the one place that may take a slot's contents away.

`leave`: what a request about to run in a slot drops of what the slot holds is kept first (saved), unless it is kept
already or worth nothing (shorter than `cache.min_tokens`: said in the log at debug level). `take`: the slot is left
holding only a beginning of what it holds (a cut for another consumer, room in the shared KV) or nothing, after
`leave`; it refuses (False) when what it would drop could not be kept. `erase_forgotten` is the one exception, a
forget: it drops on purpose. `bring_back`: the cached conversation a request goes on from is restored into its slot
when that pays (hooks/conversations/policy.py's rule)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

import structlog

from hooks.conversations.isolation import NOBODY, PUBLIC, Asker
from hooks.conversations.policy import KEPT, Candidate, Rule, decide, needs_no_keeping
from hooks.conversations.settings import CACHE
from hooks.conversations.state import Conversations
from hooks.slots.book import book_of
from hooks.slots.stores import shares_of
from hooks.slots.transfer import NotRestored, NotSaved, Saved, cost_of, restore_into, save_into
from hooks.store import Store, best_of, common_prefix
from hooks.store.settings import STORE
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation, ServerLost

log = structlog.get_logger()

Room = Callable[[int, bool], Awaitable[bool]]
"""Room made in the shared KV for a state of that many cells (hooks/conversations/room.py's `make`, for one slot)."""


# -- a conversation leaves its slot ---------------------------------------------------------------------------


async def leave(generation: Generation, conv: Conversations, store: Store, slot: int, tokens: list[int],
                why: str = "it leaves its slot") -> bool:
    """Before `tokens` go into the slot (a request's prompt, or the beginning a cut leaves): keep what they drop of
    what it holds. False when that was worth keeping and could not be kept (a save failed or was skipped)."""
    book = book_of(generation)
    reason = needs_no_keeping(book, slot, tokens, CACHE.of(generation.config).min_tokens,
                              lambda key: store.get(key) is not None)
    if reason is not None:
        if reason != KEPT and (held := book.count(slot)):
            log.debug("conversations.dropped", slot=slot, tokens=held, why=reason)
        return True
    saved, failed = await _save(generation, conv, store, slot, why)
    return saved is not None or not failed  # not failed: it held too little to keep


async def take(generation: Generation, conv: Conversations, store: Store, slot: int, keep: list[int], why: str,
               asker: Asker = NOBODY) -> bool:
    """Leave the slot holding only `keep` (a beginning of what it holds: a prefill of those tokens, which
    llama-server takes from what the slot holds, dropping the rest; an erase when there are none), once what it
    drops is kept (`leave`); False, the slot untouched, when that could not be kept. The caller holds the slot's
    lease. `asker`: the consumer whose request it is taken for (under isolation: `consumers.cut`)."""
    book = book_of(generation)
    was, held = book.owner_of(slot), book.count(slot)
    if not await leave(generation, conv, store, slot, keep, why):
        log.warning("conversations.not_taken", slot=slot, tokens=held, why=why,
                    hint="what it holds could not be kept (see the save's warning): it stays in its slot")
        return False
    await _cut(generation, slot, keep, PUBLIC if asker.isolated else was if keep else None)
    kept = book.count(slot)
    if asker.isolated:
        log.info("consumers.cut", slot=slot, of=was if was is not None else "unknown", kept=kept,
                 **({"for": asker.consumer} if asker.consumer is not None else {}))
    else:
        log.info("conversations.taken", slot=slot, tokens=held, kept=kept, why=why)
    return True


async def _cut(generation: Generation, slot: int, keep: list[int], owner: str | None) -> None:
    """`owner`: whose the beginning it keeps is (PUBLIC: anyone's)."""
    if len(keep) > 1:
        await generation.client.prefill(slot, keep)
    else:
        await generation.client.slot_action(slot, "erase")
        keep = []
    book_of(generation).cut(slot, keep, owner if keep else None)


async def erase_forgotten(generation: Generation, slot: int) -> None:
    """A forget's erase: the one move that drops a conversation without keeping it (its consumer asked for that)."""
    await generation.client.slot_action(slot, "erase")
    book_of(generation).erased(slot)


async def save_slot(generation: Generation, conv: Conversations, store: Store, slot: int, why: str,
                    min_tokens: int | None = None) -> Saved | None:
    """Save what a slot holds into the cache: what keeps it (`new` False when the store held it already), or None
    when it is not kept (too short, a failure or a skip: logged). `min_tokens`: a shorter state is not kept (default
    `cache.min_tokens`)."""
    return (await _save(generation, conv, store, slot, why, min_tokens))[0]


async def _save(generation: Generation, conv: Conversations, store: Store, slot: int, why: str,
                min_tokens: int | None = None) -> tuple[Saved | None, bool]:
    """save_slot's answer, and whether not keeping it was a failure or a skip (not: it held too little, or its
    consumer was forgotten)."""
    if book_of(generation).to_erase(slot):
        log.debug("conversations.not_saved", slot=slot, why="its consumer was forgotten: it is erased once free")
        return None, False
    limits = STORE.of(generation.config)
    store.sweep()
    if store.free_bytes() < limits.min_free:
        _skip(slot, f"less than store.min_free ({limits.min_free >> 20} MiB) is free on disk")
        return None, True
    try:
        saved = await save_into(generation, store, slot,
                                CACHE.of(generation.config).min_tokens if min_tokens is None else min_tokens,
                                min(limits.entry_max, limits.budget))
    except NotSaved as exc:
        if exc.failed:
            log.warning("conversations.save_failed", slot=slot, error=exc.reason)
        else:
            _skip(slot, exc.reason)
        return None, True
    if saved is not None and saved.entry.n_tokens:
        conv.kv_per_token = saved.entry.bytes / saved.entry.n_tokens
    if saved is None or not saved.new:
        return saved, False
    entry = saved.entry
    conv.written.append((time.time(), entry.written))
    METRICS.conv_bytes_written.inc(entry.written)
    evicted = store.evict(limits.budget, keep={entry.key}, shares=shares_of(generation.config))
    for each in evicted:
        METRICS.evicted(each.named, "folder")
    log.info("conversations.saved", slot=slot, why=why, tokens=entry.n_tokens, bytes=entry.bytes,
             written=entry.written, ms=saved.total_ms, server_ms=saved.server_ms, evicted=[e.key for e in evicted],
             **({"consumer": entry.consumer} if entry.consumer is not None else {}))
    return saved, False


def _skip(slot: int, reason: str) -> None:
    log.warning("conversations.save_skipped", slot=slot, reason=reason)


# -- a conversation comes back --------------------------------------------------------------------------------


async def bring_back(generation: Generation, conv: Conversations, store: Store, slot: int,
                     tokens: list[int], resuming: bool = False, session: str | None = None,
                     asker: Asker = NOBODY, room: Room | None = None) -> None:
    """`resuming`: a paused generation goes on; its own state is restored whenever it holds more than the slot (it
    is the KV its decoding computed: a prefill computes it another way, and the text would drift). `room(cells,
    ask)`: room made in the shared KV for a state of that many cells before it is restored (`ask`: after the server
    refused it, asking the server what the slots hold); a refused restore is tried once more after that."""
    settings = CACHE.of(generation.config)
    entry, shared = store.best(tokens) if not asker.isolated else best_of(
        [e for e in store.entries() if asker.sees(e)], tokens)
    in_slot = common_prefix(book_of(generation).holds(slot), tokens)
    candidate = None
    if entry is not None:
        cost = await cost_of(generation, store, entry)
        candidate = Candidate(shared, in_slot, cost.bytes, cost.converts, cost.fetch_s)
    kept = conv.rates_of(generation)
    decision = decide(candidate, kept.rates, Rule(settings.min_tokens, settings.restore_margin, settings.restore_rate))
    if resuming and entry is not None and shared > in_slot and not decision.restore:
        decision = replace(decision, restore=True, miss=None, gain=shared - in_slot,
                           why="a paused generation goes on from its own state")
    if entry is not None and decision.gain > 0:
        record = {"slot": slot, "entry": entry.key, "entry_tokens": entry.n_tokens, "shared": shared,
                  "in_slot": in_slot, "choice": "restore" if decision.restore else "prefill", "why": decision.why,
                  "predicted_restore_s": _round(decision.restore_s), "predicted_prefill_s": _round(decision.prefill_s),
                  **({"session": session} if session is not None else {})}
        conv.decisions.made(**record)
        # a conversation worth keeping at info; a prefix shared by chance (a system prompt) at debug
        (log.info if shared >= settings.min_tokens else log.debug)("conversations.decision", **record)
    if not decision.restore or entry is None:
        book = book_of(generation)
        if decision.miss == "the slot holds as much" and book.restored_unchanged(slot) \
                and in_slot >= settings.min_tokens:
            conv.hit(book.entry_of(slot) or f"slot {slot}", True, asker.name)  # the start's restore answers it
        else:
            conv.miss(decision.miss or "not cached", asker.name)
        return
    if room is not None and entry.n_tokens > len(tokens):
        await room(entry.n_tokens, False)
    try:
        try:
            done = await restore_into(generation, store, entry, slot)
        except NotRestored as exc:
            if not exc.failed or room is None:
                raise
            book_of(generation).cut(slot, [], None)  # a refused restore leaves the slot empty
            if not await room(entry.n_tokens, True):
                raise
            log.info("conversations.restore_again", slot=slot, entry=entry.key, reason=exc.reason,
                     why="room made in the shared KV")
            done = await restore_into(generation, store, entry, slot)
    except NotRestored as exc:
        if exc.failed:
            book_of(generation).cut(slot, [], None)
        conv.miss("the server refused it" if exc.failed else "not usable", asker.name)
        log.info("conversations.entry_skipped", entry=entry.key, reason=exc.reason, removed=exc.damaged)
        if exc.damaged:
            store.remove(entry)
        return
    except ServerLost:
        conv.miss("the server died restoring it", asker.name)
        raise
    if isinstance(done.conversion, dict):
        kept.rates.learn_convert(entry.bytes, done.conversion["ms"] / 1000)
        log.info("conversations.converted", entry=entry.key, ms=done.conversion["ms"], to=done.conversion["to"])
    kept.rates.learn_restore(done.entry.bytes, done.total_ms / 1000)
    if done.entry.n_tokens:
        conv.kv_per_token = done.entry.bytes / done.entry.n_tokens
    kept.save()
    store.touch(done.entry)
    conv.hit(done.entry.key, consumer=asker.name)
    log.info("conversations.restored", slot=slot, entry=done.entry.key, tokens=done.n_restored,
             bytes=done.entry.bytes, ms=done.total_ms,
             **({"consumer": done.entry.consumer} if done.entry.consumer is not None else {}))


def _round(seconds: float | None) -> float | None:
    return round(seconds, 3) if seconds is not None else None
