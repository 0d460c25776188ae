"""The step before each completion request the wrapper pins (`id_slot`): learn its tokens, choose its slot, keep what
leaves that slot and bring back the cached conversation it continues when that pays (hooks/conversations/moves.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from hooks.conversations import room
from hooks.conversations.chain import Messages, messages_of
from hooks.conversations.checkpoints import after_answer
from hooks.conversations.isolation import NOBODY, Asker, asker_of, uncached
from hooks.conversations.moves import bring_back, leave, save_slot, take
from hooks.conversations.placed import Placement, clear_for, keep_idle, processing, settled, steered, unpinned
from hooks.conversations.policy import (
    SLOT_PROMPT_SIMILARITY,
    choose_slot,
    goes_on_in,
    server_places,
    within_slot_shares,
)
from hooks.conversations.prompts import chat_body
from hooks.conversations.room import answer_room
from hooks.conversations.settings import CACHE
from hooks.conversations.state import Conversations, counted, enabled, state
from hooks.slots.book import PINNED, book_of
from hooks.slots.stores import store_of
from hooks.store import Entry, Store, Unreadable, common_prefix
from wrapper import paths
from wrapper.configuration import argv as args
from wrapper.configuration.consumers import CONSUMERS
from wrapper.server.generation import Generation, Host, ServerLost
from wrapper.server.llama import LlamaError
from wrapper.steps import Outgoing, limit

log = structlog.get_logger()

PATHS = paths.CONVERSING
WAIT_FOR_SLOT_S = 600.0
KEPT_WAIT_S = 30.0  # a checkpoint under way is waited for this long at most (the server's loop is busy with it)


async def before(host: Host, out: Outgoing) -> Outgoing:
    generation = host.current
    store = store_of(generation)
    if not enabled(generation) or store is None or out.payload is None:
        return out
    chat = out.payload if out.path in paths.CHAT else chat_body(out.path, out.payload)
    if out.path in (*paths.RESPONSES, *paths.MESSAGES) and chat is None:
        return await unpinned(host, out)  # a shape whose prompt cannot be told here: the server places it
    steering = out.path in paths.MESSAGES  # the server drops its id_slot: prepared where its own rule puts it
    book = await counted(generation)  # a new server's first request: a stream it went on with may hold this
    await state(generation).leases.until_kept(KEPT_WAIT_S)  # a checkpoint right after the last answer: it may be this
    # conversation's slot, which this request must not leave for another
    resuming = out.use is not None and out.use.pauses > 0
    messages = messages_of(chat) if chat is not None and not steering else None
    asker = await asker_of(generation, state(generation).public, out.asked.consumer)
    if messages is not None and not resuming and book.total and not state(generation).unpinned:
        asked = out.payload.get("id_slot")
        slot = continuing(generation, conv := state(generation), store, messages,
                          asked if isinstance(asked, int) and asked >= 0 else None, asker)
        if slot is not None:
            await _room_to_go_on(host, generation, conv, store, out, chat, slot)
            return _continued(host, generation, conv, store, out, slot, messages, asker)
    try:
        tokens = await _tokens(generation, out, chat)
    except (LlamaError, ValueError, TypeError) as exc:
        log.debug("conversations.no_tokens", path=out.path, error=str(exc))
        if steering or out.path in paths.RESPONSES:
            return await unpinned(host, out)
        book.forgotten()
        return uncached(out, asker)  # the server tokenizes it its own way; this request is not pinned
    conv = state(generation)
    if steering and asker.wary(book) and not await host.survive(lambda: clear_for(generation, conv, asker)):
        return uncached(out, asker)  # a slot of another's was not cut: wherever it goes, nothing may be reused
    foretold = await _foretold(generation, conv, tokens) if steering else None
    asked = foretold if steering else out.payload.get("id_slot")
    if steering and foretold is None:
        return await unpinned(host, out)  # where the server puts it cannot be told (a slot it does not know)
    if foretold is not None and common_prefix(book.holds(foretold), tokens) <= len(tokens) * SLOT_PROMPT_SIMILARITY:
        await host.survive(lambda: keep_idle(generation, conv))  # foretold by the least recent use, which the
        # wrapper only approximates: every idle slot it may land in is kept first
    book.pinned()  # every completion is pinned (or makes the book forget): it says what the slots hold
    if isinstance(asked, int) and asked >= max(1, book.total):
        return out  # a slot the server does not have: it answers that itself
    background = out.asked.background
    slot = await _reserve(generation, conv, tokens, asked if isinstance(asked, int) and asked >= 0 else None,
                          background, asker)
    if slot is None:
        return uncached(out, asker)
    reserved = _Reserved(slot, messages, asker.consumer)
    out.after.append(lambda status: _release(host, generation, conv, store, reserved, tokens, status))
    out.keep.append(lambda: _keep(host, generation, conv, store, reserved))
    if out.use is not None:
        out.use.tokens, out.use.slot = len(tokens), slot
        if not out.use.counted:
            out.use.prompt, out.use.counted = len(tokens), True
    try:
        session = out.asked.session
        answer = answer_room(limit(out.payload))
        made = await host.survive(lambda: _make_room_and_bring_back(generation, conv, store, slot, tokens, answer,
                                                                    resuming, session, asker))
        if made is None:
            log.error("conversations.server_lost", slot=slot)  # the entry set aside, the server started again
            return uncached(out, asker)  # to the server started again, unpinned
        if not made:
            return uncached(out, asker)
    except Exception:  # a bug or a server error here must never fail the request: it is served, not pinned
        log.exception("conversations.internal_error", slot=slot)
        if asker.foreign(book, slot):
            return uncached(out, asker)
    if steering:
        reserved.placement = steered(generation, conv, out, slot)
        PINNED.set(slot)
        return out
    return _pinned(out, slot)


async def _foretold(generation: Generation, conv: Conversations, tokens: list[int]) -> int | None:
    """The slot llama-server will put a request it places itself in, by its own rule (policy.server_places); None
    when that cannot be told (an idle slot whose tokens are not known)."""
    book = book_of(generation)
    running = await processing(generation) | conv.leases.placed
    idle = {s: None if book.partial(s) else book.holds(s) for s in range(max(1, book.total)) if s not in running}
    try:
        similarity = float(args.get(generation.launch.argv, args.SLOT_PROMPT_SIMILARITY) or SLOT_PROMPT_SIMILARITY)
    except ValueError:
        return None
    return server_places(tokens, idle, conv.leases.last_used, similarity)


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
    others = {s for s in range(book.total) if not asker.mine(book.owner_of(s)) or book.to_erase(s)}  # under
    # isolation, and a forgotten conversation's
    slot = goes_on_in(book, conv.leases.busy | others, asked, messages, CACHE.of(generation.config).min_tokens,
                      longer_kept)
    if slot is not None:
        conv.leases.serve(slot, asker.consumer)
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
    out.after.append(lambda status: _release(host, generation, conv, store, reserved, None, status))
    out.keep.append(lambda: _keep(host, generation, conv, store, reserved))
    if out.use is not None:
        out.use.tokens, out.use.slot = book.count(slot), slot
        out.use.counted = True  # its own prompt is not counted: a resumed answer's usage takes the server's
    return _pinned(out, slot)


async def _room_to_go_on(host: Host, generation: Generation, conv: Conversations, store: Store, out: Outgoing,
                         chat: dict[str, Any] | None, slot: int) -> None:
    """A conversation that goes on in its slot grows there by its new messages and its answer: when the shared KV may
    not hold that, its prompt is counted and room made (else llama-server purges another slot: seen after a start
    that restored 8,098 tokens into -c 8192). The prompt is tokenized only then: this is the fast path."""
    cells = room.pool(generation)
    if cells is None or out.payload is None:
        return
    book = book_of(generation)
    answer = answer_room(limit(out.payload))
    if not any(book.partial(s) for s in book.slots()) and \
            sum(book.count(s) for s in book.slots()) + room.TURN_ROOM + answer <= cells:
        return
    try:
        tokens = await _tokens(generation, out, chat)
    except (LlamaError, ValueError, TypeError):
        return  # not counted: the server decides
    await host.survive(lambda: room.make(generation, conv, store, slot, len(tokens) + answer))


async def _make_room_and_bring_back(generation: Generation, conv: Conversations, store: Store, slot: int,
                                    tokens: list[int], answer: int, resuming: bool, session: str | None,
                                    asker: Asker) -> bool:
    """Keep what leaves the slot, make room in the shared KV for the prompt and its answer (`answer` cells), and
    bring its conversation back. False when the slot holds another consumer's conversation that could not be kept
    (so not cut either): the request must not be pinned there."""
    try:
        book = book_of(generation)
        if asker.foreign(book, slot):  # another consumer's: kept, then cut down to the public beginning they share
            keep = 0 if book.partial(slot) else min(common_prefix(book.holds(slot), tokens), asker.reach(tokens))
            if not await take(generation, conv, store, slot, tokens[:keep], "another consumer's request", asker):
                return False
        else:
            await leave(generation, conv, store, slot, tokens)
        await room.make(generation, conv, store, slot, len(tokens) + answer)

        async def room_for(cells: int, ask: bool) -> bool:  # a restore of a longer state, or one the server refused
            return await room.make(generation, conv, store, slot, max(cells, len(tokens) + answer), ask)

        await bring_back(generation, conv, store, slot, tokens, resuming, session, asker, room_for)
        room.compact_soon(generation, conv, store, slot, CACHE.of(generation.config).min_tokens)
    except ServerLost:
        book_of(generation).forgotten()  # before the server is started again: its start restores what it can
        raise
    return True


async def _tokens(generation: Generation, out: Outgoing, chat: dict[str, Any] | None) -> list[int]:
    """The request's prompt as llama-server tokenizes it: a chat body (a chat request's, or what the server makes of
    a Responses or Messages one) through its template, else its prompt."""
    payload = out.payload
    assert payload is not None
    client = generation.client
    if chat is not None:
        template = await client.call("POST", "/apply-template", chat)
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
    leases = conv.leases
    deadline = time.monotonic() + WAIT_FOR_SLOT_S
    await settled(conv)  # the server may not have placed its own yet: the slot it takes must not be this one
    while True:
        elsewhere = (await processing(generation) | leases.placed) if conv.unpinned else set()
        free = [s for s in range(max(1, book.total)) if leases.free(s) and s not in elsewhere
                and not book.to_erase(s) and (asked is None or s == asked)]
        if free:
            break
        if time.monotonic() > deadline:
            return None
        await leases.until_freed(5.0)
    public = asker.reach(tokens)
    slot_shares = {name: share.slots for name, share in CONSUMERS.of(generation.config).shares
                   if share.slots is not None}
    free, last = within_slot_shares(free, {s: book.owner_of(s) for s in book.slots()}, asker.consumer, slot_shares)
    slot = choose_slot(free, book.known(), tokens, leases.last_used, CACHE.of(generation.config).min_tokens,
                       {s for s in free if book.partial(s)},
                       {s for s in free if leases.background.get(s, background) == background},
                       {s: public for s in free if asker.foreign(book, s)}, last)
    leases.serve(slot, asker.consumer)
    leases.background[slot] = background
    return slot


@dataclass
class _Reserved:
    """A request's slot, until it is answered or paused (then `_keep` let it go)."""

    slot: int
    messages: Messages | None  # the request's, when it is a chat request
    consumer: str | None = None  # whose request it is (`consumers:`): what it leaves in the slot is its
    continued: bool = False  # it went on in the slot holding its conversation, its tokens not told
    released: bool = False
    placement: Placement | None = None  # a request the server placed itself where it was prepared (Messages)


def _release(host: Host, generation: Generation, conv: Conversations, store: Store, reserved: _Reserved,
             tokens: list[int] | None, status: int | None) -> None:
    """The request is answered (or cut) on the server it was stepped on: that slot holds something new. (A request
    that goes on on another server — after a crash, a reload's hand-over, a growth — runs the steps again there, and
    that run tells its own server's book: wrapper/answers/passes.py.)"""
    if reserved.released:
        return  # paused: what the slot holds was kept, and the book says what it is
    if reserved.placement is not None and reserved.placement.slot not in (None, reserved.slot):
        _let_go(conv, reserved)  # it ran elsewhere (placed.steered told the book): this slot holds what it held
        return
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
    if answered:
        after_answer(host, generation, conv, store, reserved.slot)  # an agent's next turn leaves no quiet moment


def _let_go(conv: Conversations, reserved: _Reserved) -> None:
    """The slot is free for another request of ours."""
    reserved.released = True
    conv.leases.let_go(reserved.slot)


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
