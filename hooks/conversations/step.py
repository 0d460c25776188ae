"""The step before each completion request: learn its tokens, choose its slot and pin it there (`id_slot`),
save what leaves that slot, and bring back the cached conversation it continues when that pays."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, replace

import structlog

from hooks.conversations.chain import Messages, messages_of
from hooks.conversations.isolation import NOBODY, Asker, asker_of, cut
from hooks.conversations.policy import (
    UNTOLD,
    Candidate,
    Rule,
    choose_slot,
    decide,
    dropped,
    goes_on_in,
    placed_in,
    within_slot_shares,
)
from hooks.conversations.settings import CACHE
from hooks.conversations.state import Conversations, enabled, state
from hooks.slots.book import PINNED, SlotBook, book_of
from hooks.slots.stores import shares_of, store_of
from hooks.slots.transfer import NotRestored, NotSaved, cost_of, restore_into, save_into
from hooks.store import Entry, Store, Unreadable, best_of, common_prefix
from hooks.store.settings import STORE
from wrapper import paths
from wrapper.configuration import argv as args
from wrapper.configuration.consumers import CONSUMERS
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation, Host, ServerLost
from wrapper.server.llama import LlamaError
from wrapper.steps import Outgoing, SlotUse

log = structlog.get_logger()

PATHS = paths.CONVERSING
WAIT_FOR_SLOT_S = 600.0


async def before(host: Host, out: Outgoing) -> Outgoing:
    generation = host.current
    store = store_of(generation)
    if not enabled(generation) or store is None or out.payload is None:
        return out
    book = await counted(generation)  # a new server's first request: a stream it went on with may hold this
    resuming = out.use is not None and out.use.pauses > 0
    messages = messages_of(out.payload) if out.path in paths.CHAT else None
    asker = await asker_of(generation, state(generation).public, out.consumer)
    if messages is not None and not resuming and book.total and not state(generation).unpinned:
        asked = out.payload.get("id_slot")
        slot = continuing(generation, conv := state(generation), store, messages,
                          asked if isinstance(asked, int) and asked >= 0 else None, asker)
        if slot is not None:
            return _continued(host, generation, conv, store, out, slot, messages, asker)
    try:
        tokens = await _tokens(generation, out)
    except (LlamaError, ValueError, TypeError) as exc:
        log.debug("conversations.no_tokens", path=out.path, error=str(exc))
        book.forgotten()
        return _uncached(out, asker)  # the server tokenizes it its own way; this request is not pinned
    book.pinned()  # every completion is pinned (or makes the book forget): it says what the slots hold
    conv = state(generation)
    asked = out.payload.get("id_slot")
    if isinstance(asked, int) and asked >= max(1, book.total):
        return out  # a slot the server does not have: it answers that itself
    background = out.use is not None and out.use.background
    slot = await _reserve(generation, conv, tokens, asked if isinstance(asked, int) and asked >= 0 else None,
                          background, asker)
    if slot is None:
        return _uncached(out, asker)
    reserved = _Reserved(slot, messages, asker.consumer)
    out.after.append(lambda status: _release(generation, conv, reserved, tokens, status))
    out.keep.append(lambda: _keep(host, generation, conv, store, reserved))
    if out.use is not None:
        out.use.tokens, out.use.slot = len(tokens), slot
        if not out.use.counted:
            out.use.prompt, out.use.counted = len(tokens), True
    try:
        session = out.use.session if out.use is not None else None
        if await host.survive(lambda: _make_room_and_bring_back(generation, conv, store, slot, tokens,
                                                                resuming, session, asker)) is None:
            log.error("conversations.server_lost", slot=slot)  # the entry set aside, the server started again
            return _uncached(out, asker)  # to the server started again, unpinned
    except Exception:  # a bug or a server error here must never fail the request: it is served, not pinned
        log.exception("conversations.internal_error", slot=slot)
        if asker.foreign(book, slot):
            return _uncached(out, asker)
    return _pinned(out, slot)


async def counted(generation: Generation) -> SlotBook:
    """The book, once it knows how many slots the server runs (asked at a new server's first need of it: its start
    may have restored conversations into them)."""
    book = book_of(generation)
    if not book.total:
        with contextlib.suppress(LlamaError):
            book.learnt_total(int((await generation.props()).get("total_slots") or 1))
    return book


def _uncached(out: Outgoing, asker: Asker) -> Outgoing:
    """A request the wrapper does not pin: under isolation it is told to reuse nothing (`cache_prompt: false`), since
    the slot llama-server chooses may hold another consumer's conversation."""
    if asker.isolated and out.payload is not None:
        out.payload["cache_prompt"] = False
        out.body = json.dumps(out.payload).encode()
    return out


async def unpinned(host: Host, out: Outgoing) -> Outgoing:
    """A request the server puts in a slot of its own choosing: while it runs, a pinned one is kept off that slot
    (the server would queue it there, behind it); the slot it ran in is learnt from the server's `/slots` while it
    runs, and when it ends only that slot holds something the book does not know (every slot, when that was not
    learnt: two such requests at once, or one too short to be seen)."""
    generation = host.current
    if not enabled(generation):
        return out
    conv = state(generation)
    await counted(generation)  # the slots it may land in: every one is untracked when its place is not seen
    asker = await asker_of(generation, conv.public, out.consumer)
    conv.unpinned += 1
    conv.placing += 1
    if asker.isolated:
        try:
            if not await host.survive(lambda: _clear_for(generation, conv, asker)):
                out = _uncached(out, asker)  # a slot of another's was not cut: nothing may be reused
        except Exception:  # never fails the request: it is served reusing nothing
            log.exception("conversations.internal_error", step="clear_for")
            out = _uncached(out, asker)
    conversing = out.path in (*paths.RESPONSES, *paths.MESSAGES)
    placed = _Placed(use=out.use)
    finding = asyncio.create_task(_find_place(generation, conv, placed))
    conv.finding.add(finding)
    finding.add_done_callback(conv.finding.discard)

    def ended(status: int | None) -> None:
        if placed.done:
            return
        placed.done = True
        finding.cancel()
        _settled(conv, placed)
        conv.unpinned -= 1
        book = book_of(generation)
        now = time.monotonic()
        if placed.slot is not None:
            conv.placed.discard(placed.slot)
            conv.background.pop(placed.slot, None)
            conv.last_used[placed.slot] = now  # a checkpoint waits for a quiet moment after it too
            book.served(placed.slot, None, owner=asker.consumer)  # it holds what that request left: saved before a
            # conversation takes it
            if not conversing:
                book.unkeepable(placed.slot)  # embeddings, rerank, infill: no conversation to checkpoint
        else:
            book.forgotten()
            conv.last_used.update({slot: now for slot in book.slots()})
        conv.freed.set()

    out.after.append(ended)
    return out


async def _clear_for(generation: Generation, conv: Conversations, asker: Asker) -> bool:
    """Before a request the server places itself, under isolation: every free slot holding another consumer's
    conversation is kept and cut down to the public beginning (the server would reuse whatever prefix the slot it
    chooses holds); False when one could not be (busy: a save under way), and the request must reuse nothing."""
    book, store = await counted(generation), store_of(generation)
    assert store is not None
    running = await _processing(generation) | conv.placed
    whole = True
    for slot in range(book.total):
        if slot in running or not asker.foreign(book, slot):
            continue
        if slot in conv.busy:  # being saved (a checkpoint) or about to serve: not cut, so nothing may be reused
            whole = False
            continue
        conv.busy.add(slot)
        try:
            keep = asker.public[:0 if book.partial(slot) else common_prefix(book.holds(slot), asker.public)]
            await _make_room(generation, conv, store, slot, keep)
            await cut(generation, slot, keep, asker)
        finally:
            conv.busy.discard(slot)
            conv.freed.set()
    return whole


@dataclass
class _Placed:
    """Where the server put a request of its own choosing, once seen."""

    slot: int | None = None
    done: bool = False
    settled: bool = False  # its place is known, or will not be: pinned requests need not wait for it
    use: SlotUse | None = None  # the seat's, told the slot once seen (the status shows it)


def _settled(conv: Conversations, placed: _Placed) -> None:
    if not placed.settled:
        placed.settled = True
        conv.placing -= 1
        conv.settling.set()
        conv.settling = asyncio.Event()


PLACE_POLL_S = 0.1
PLACE_TRIES = 100  # about 10 s of polls: a request still unseen then is left unknown (its end forgets every slot)


async def _find_place(generation: Generation, conv: Conversations, placed: _Placed) -> None:
    """Poll the server's `/slots` until one slot processes that no request of ours is pinned to and no other such
    request was seen in: that is where this one runs. Given up when two such slots are there at once (which is
    whose cannot be told)."""
    try:
        for _ in range(PLACE_TRIES):
            await asyncio.sleep(PLACE_POLL_S)
            if placed.done:
                return
            seen = placed_in(await _processing(generation), conv.placed | conv.busy)
            if seen == UNTOLD:
                return
            if seen is not None and not placed.done:
                placed.slot = seen
                conv.placed.add(seen)
                if placed.use is not None:
                    placed.use.slot = seen
                return
    finally:
        _settled(conv, placed)


def _pinned(out: Outgoing, slot: int) -> Outgoing:
    assert out.payload is not None
    out.payload["id_slot"] = slot
    out.body = json.dumps(out.payload).encode()
    PINNED.set(slot)
    return out


def continuing(generation: Generation, conv: Conversations, store: Store, messages: Messages,
               asked: int | None, asker: Asker = NOBODY) -> int | None:
    """The free slot holding the conversation this chat request goes on from (policy.goes_on_in), reserved for it;
    None when no slot does, or when the store may hold more of it than that slot (then the whole lookup decides). The
    slot then shares with the request at least what the book knows it holds, no entry can win `cache.min_tokens`
    over it, and nothing leaves it: no template, tokens or lookup are needed."""
    if _shifts(generation.launch.argv):
        return None  # its cache_n counts chunks reused out of place: not what the slot holds first

    def longer_kept(known: list[int], tokens: int) -> bool:
        return any(_begins_with(entry, known) for entry in store.entries()
                   if entry.n_tokens >= tokens and asker.sees(entry))

    book = book_of(generation)
    others = {s for s in range(book.total) if not asker.mine(book.owner_of(s))}  # under isolation
    slot = goes_on_in(book, conv.busy | others, asked, messages, CACHE.of(generation.config).min_tokens, longer_kept)
    if slot is not None:
        conv.busy.add(slot)
    return slot


def _shifts(argv: list[str]) -> bool:
    try:
        return int(args.get(argv, args.CACHE_REUSE) or 0) > 0
    except ValueError:
        return True


def _begins_with(entry: Entry, known: list[int]) -> bool:
    try:
        tokens = entry.tokens
    except Unreadable:
        return False
    return tokens[:len(known)] == known


def _continued(host: Host, generation: Generation, conv: Conversations, store: Store, out: Outgoing, slot: int,
               messages: Messages, asker: Asker) -> Outgoing:
    """A request that goes on in the slot holding its conversation: pinned there as it is."""
    book = book_of(generation)
    book.pinned()
    conv.continued += 1
    reserved = _Reserved(slot, messages, asker.consumer, continued=True)
    out.after.append(lambda status: _release(generation, conv, reserved, None, status))
    out.keep.append(lambda: _keep(host, generation, conv, store, reserved))
    if out.use is not None:
        out.use.tokens, out.use.slot = book.count(slot), slot
        out.use.counted = True  # its own prompt is not counted: a resumed answer's usage takes the server's
    return _pinned(out, slot)


async def _make_room_and_bring_back(generation: Generation, conv: Conversations, store: Store, slot: int,
                                    tokens: list[int], resuming: bool, session: str | None, asker: Asker) -> bool:
    try:
        book = book_of(generation)
        if asker.foreign(book, slot):  # another consumer's: kept, then cut down to the public beginning they share
            keep = 0 if book.partial(slot) else min(common_prefix(book.holds(slot), tokens), asker.reach(tokens))
            await _make_room(generation, conv, store, slot, tokens[:keep])
            await cut(generation, slot, tokens[:keep], asker)
        else:
            await _make_room(generation, conv, store, slot, tokens)
        await _bring_back(generation, conv, store, slot, tokens, resuming, session, asker)
    except ServerLost:
        book_of(generation).forgotten()  # before the server is started again: its start restores what it can
        raise
    return True


async def _tokens(generation: Generation, out: Outgoing) -> list[int]:
    payload = out.payload
    assert payload is not None
    client = generation.client
    if out.path in paths.CHAT:
        template = await client.call("POST", "/apply-template", payload)
        text = template["prompt"]
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise ValueError("a prompt that is not one string")
        text = prompt
    tokenized = await client.call("POST", "/tokenize", {"content": text, "add_special": True,
                                                        "parse_special": True})
    return [int(t) for t in tokenized["tokens"]]


async def _reserve(generation: Generation, conv: Conversations, tokens: list[int], asked: int | None,
                   background: bool, asker: Asker = NOBODY) -> int | None:
    """The slot for this request, reserved until it is answered; waits while every slot serves one of ours (the
    server would queue it the same way, and then put it in a slot whose conversation nobody saved)."""
    book = book_of(generation)
    deadline = time.monotonic() + WAIT_FOR_SLOT_S
    placing_until = time.monotonic() + PLACE_POLL_S * PLACE_TRIES
    while conv.placing > 0 and (left := placing_until - time.monotonic()) > 0:  # the server may not have placed
        settling = conv.settling  # it yet: the slot it takes must not be the one this request is pinned to
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settling.wait(), timeout=left)
    while True:
        elsewhere = (await _processing(generation) | conv.placed) if conv.unpinned else set()
        free = [s for s in range(max(1, book.total)) if s not in conv.busy and s not in elsewhere
                and (asked is None or s == asked)]
        if free:
            break
        if time.monotonic() > deadline:
            return None
        conv.freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conv.freed.wait(), timeout=5.0)
    public = asker.reach(tokens)
    slot_shares = {name: share.slots for name, share in CONSUMERS.of(generation.config).shares
                   if share.slots is not None}
    free, last = within_slot_shares(free, {s: book.owner_of(s) for s in book.slots()}, asker.consumer, slot_shares)
    slot = choose_slot(free, book.known(), tokens, conv.last_used, CACHE.of(generation.config).min_tokens,
                       {s for s in free if book.partial(s)},
                       {s for s in free if conv.background.get(s, background) == background},
                       {s: public for s in free if asker.foreign(book, s)}, last)
    conv.busy.add(slot)
    conv.background[slot] = background
    return slot


async def _processing(generation: Generation) -> set[int]:
    """The slots the server says are busy (a request it placed itself runs there)."""
    try:
        return {int(s["id"]) for s in await generation.client.slots() if s.get("is_processing")}
    except (LlamaError, KeyError, TypeError, ValueError):
        return set()


@dataclass
class _Reserved:
    """A request's slot, until it is answered or paused (then `_keep` let it go)."""

    slot: int
    messages: Messages | None  # the request's, when it is a chat request
    consumer: str | None = None  # whose request it is (`consumers:`): what it leaves in the slot is its
    continued: bool = False  # it went on in the slot holding its conversation, its tokens not told
    released: bool = False


def _release(generation: Generation, conv: Conversations, reserved: _Reserved, tokens: list[int] | None,
             status: int | None) -> None:
    """The request is answered (or cut) on the server it was stepped on: that slot holds something new. (A request
    that goes on on another server — after a crash, a reload's hand-over, a growth — runs the steps again there, and
    that run tells its own server's book: wrapper/answers/passes.py.)"""
    if reserved.released:
        return  # paused: what the slot holds was kept, and the book says what it is
    answered = status is not None and status < 400
    chain = reserved.messages.chain() if reserved.messages is not None and answered else None
    book = book_of(generation)
    if not reserved.continued:
        book.served(reserved.slot, tokens if answered else None, chain, reserved.consumer)
    elif chain is not None:  # it went on from what the slot held: the answer says how much of it the server kept
        book.continued(reserved.slot, chain)
    else:  # no answer: unknown
        book.served(reserved.slot, None, owner=reserved.consumer)
    _let_go(conv, reserved)


def _let_go(conv: Conversations, reserved: _Reserved) -> None:
    """The slot is free for another request of ours."""
    reserved.released = True
    conv.busy.discard(reserved.slot)
    conv.last_used[reserved.slot] = time.monotonic()
    conv.freed.set()


async def _keep(host: Host, generation: Generation, conv: Conversations, store: Store, reserved: _Reserved) -> int:
    """A paused request: keep what its slot holds (its prompt and what it generated, whatever its length: it is
    the state its resume goes on from) and let the slot go; the tokens the slot holds."""
    slot = reserved.slot
    if not reserved.released:
        book_of(generation).served(slot, None, owner=reserved.consumer)  # unknown unless the save says what it holds
        await host.survive(lambda: save_slot(generation, conv, store, slot, "paused for an interactive request",
                                             min_tokens=1))
        _let_go(conv, reserved)
    return len(book_of(generation).holds(slot))


# -- a conversation leaves its slot ---------------------------------------------------------------------------


async def _make_room(generation: Generation, conv: Conversations, store: Store, slot: int,
                     tokens: list[int]) -> None:
    book = book_of(generation)
    settings = CACHE.of(generation.config)
    count = book.count(slot)  # its prompt and the answer it generated
    if book.partial(slot):  # it may hold more than the book says: saved (a state too short is not kept)
        await save_slot(generation, conv, store, slot, "it leaves its slot")
        return
    if count < settings.min_tokens:
        return  # too short to keep
    if dropped(book.holds(slot), count, tokens) < settings.min_tokens:
        return  # this request goes on with it (what it drops is too little to keep): it does not leave
    if (key := book.entry_of(slot)) is not None and store.get(key) is not None:
        return  # unchanged since it was saved or restored: the store holds it
    await save_slot(generation, conv, store, slot, "it leaves its slot")


async def save_slot(generation: Generation, conv: Conversations, store: Store, slot: int, why: str,
                    min_tokens: int | None = None) -> Entry | None:
    """Save what a slot holds into the cache (unless it is there already); None when nothing was written.
    `min_tokens`: a shorter state is not kept (default `cache.min_tokens`)."""
    limits = STORE.of(generation.config)
    store.sweep()
    if store.free_bytes() < limits.min_free:
        _skip(slot, f"less than store.min_free ({limits.min_free >> 20} MiB) is free on disk")
        return None
    try:
        saved = await save_into(generation, store, slot,
                                CACHE.of(generation.config).min_tokens if min_tokens is None else min_tokens,
                                min(limits.entry_max, limits.budget))
    except NotSaved as exc:
        if exc.failed:
            log.warning("conversations.save_failed", slot=slot, error=exc.reason)
        else:
            _skip(slot, exc.reason)
        return None
    if saved is None or not saved.new:
        return None
    entry = saved.entry
    conv.written.append((time.time(), entry.written))
    METRICS.conv_bytes_written.inc(entry.written)
    evicted = store.evict(limits.budget, keep={entry.key}, shares=shares_of(generation.config))
    for each in evicted:
        METRICS.evicted(each.consumer, "folder")
    log.info("conversations.saved", slot=slot, why=why, tokens=entry.n_tokens, bytes=entry.bytes,
             written=entry.written, ms=saved.total_ms, server_ms=saved.server_ms, evicted=[e.key for e in evicted],
             **({"consumer": entry.consumer} if entry.consumer is not None else {}))
    return entry


def _skip(slot: int, reason: str) -> None:
    log.warning("conversations.save_skipped", slot=slot, reason=reason)


# -- a conversation comes back --------------------------------------------------------------------------------


async def _bring_back(generation: Generation, conv: Conversations, store: Store, slot: int,
                      tokens: list[int], resuming: bool = False, session: str | None = None,
                      asker: Asker = NOBODY) -> None:
    """`resuming`: a paused generation goes on; its own state is restored whenever it holds more than the slot (it
    is the KV its decoding computed: a prefill computes it another way, and the text would drift)."""
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
            conv.hit(book.entry_of(slot) or f"slot {slot}", True, asker.consumer)  # the start's restore answers it
        else:
            conv.miss(decision.miss or "not cached", asker.consumer)
        return
    try:
        done = await restore_into(generation, store, entry, slot)
    except NotRestored as exc:
        conv.miss("the server refused it" if exc.failed else "not usable", asker.consumer)
        log.info("conversations.entry_skipped", entry=entry.key, reason=exc.reason, removed=exc.damaged)
        if exc.damaged:
            store.remove(entry)
        return
    except ServerLost:
        conv.miss("the server died restoring it", asker.consumer)
        raise
    if isinstance(done.conversion, dict):
        kept.rates.learn_convert(entry.bytes, done.conversion["ms"] / 1000)
        log.info("conversations.converted", entry=entry.key, ms=done.conversion["ms"], to=done.conversion["to"])
    kept.rates.learn_restore(done.entry.bytes, done.total_ms / 1000)
    kept.save()
    store.touch(done.entry)
    conv.hit(done.entry.key, consumer=asker.consumer)
    log.info("conversations.restored", slot=slot, entry=done.entry.key, tokens=done.n_restored,
             bytes=done.entry.bytes, ms=done.total_ms,
             **({"consumer": done.entry.consumer} if done.entry.consumer is not None else {}))


def _round(seconds: float | None) -> float | None:
    return round(seconds, 3) if seconds is not None else None
