"""Room in the shared KV, made by the wrapper before llama-server has to: with `-kvu` every slot draws its cells from
one pool of `-c`, and when a prompt does not fit in the free cells llama-server erases an idle slot of its own choosing
(`purging slot N with M tokens` in its log) — a conversation gone, never saved, while the book thinks it is there.

So before a prompt goes into a slot (and before a restore there), the cells it will hold (its tokens and what its
answer may add) are weighed against what the other slots hold (llama-server's `/slots`, asked only when the book
cannot tell that it fits): when they do not fit, the least valuable idle slots are taken (hooks/conversations/moves.py:
kept first, then erased) until they do — never a slot a request runs in or one of ours, and a person's
conversation last. A purge seen anyway (a request the server placed itself,
an answer longer than foreseen) is reported as a loss (`conversations.purged`, status `purged`)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import structlog

from hooks.conversations.moves import take
from hooks.conversations.policy import ASSUMED_RESTORE_BPS
from hooks.conversations.state import Conversations, state
from hooks.slots.book import book_of
from hooks.store import Store
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaError

log = structlog.get_logger()

ANSWER_ROOM = 1024  # cells kept for the answer of a request that says no max_tokens (a longer one may still purge)
TURN_ROOM = 512  # cells a turn's new messages may add to its conversation before its prompt is counted
_PURGED = re.compile(r"purging slot (\d+) with (\d+) tokens")


@dataclass(frozen=True)
class Held:
    """What a slot holds as llama-server says it (`/slots`)."""

    tokens: int
    processing: bool


def pool(generation: Generation) -> int | None:
    """The cells every slot draws from, with one KV for all slots (`-kvu`); None when each slot has its own."""
    context = generation.context
    if context is None or not context.unified:
        return None
    return context.runs


async def make(generation: Generation, conv: Conversations, store: Store, slot: int, final: int,
               ask: bool = False) -> bool:
    """Before `slot` holds `final` cells (a prompt and its answer, or a restored state): take other slots until they
    fit in the pool; False when they cannot be made to fit (logged: llama-server may then purge). `ask`: ask the
    server what the slots hold even when the book says it fits (a restore it refused)."""
    cells = pool(generation)
    if cells is None or final > cells:
        return True  # each slot has its own cells; or it cannot fit anyway (the server answers that itself)
    book = book_of(generation)
    others = [s for s in book.slots() if s != slot]
    if not ask and not any(book.partial(s) for s in others) and sum(book.count(s) for s in others) + final <= cells:
        return True  # the book knows every other slot, and they fit
    try:
        held = await _held(generation)
    except LlamaError:
        return True  # not known: the server decides
    used = sum(h.tokens for s, h in held.items() if s != slot)
    if used + final <= cells:
        return True
    leases = conv.leases
    victims = [s for s, h in held.items() if s != slot and h.tokens and not h.processing and leases.free(s)
               and s not in leases.placed]
    victims.sort(key=lambda s: (leases.background.get(s) is False,  # a person's conversation last
                                book.entry_of(s) is None and not book.restored_unchanged(s),  # kept: no save
                                leases.last_used.get(s, 0.0)))
    for victim in victims:
        async with leases.holding(victim):
            if await take(generation, conv, store, victim, [], f"room in the shared KV for slot {slot}"):
                used -= held[victim].tokens
                METRICS.conv_room.inc()
        if used + final <= cells:
            return True
    log.warning("conversations.no_room", slot=slot, needs=final, pool=cells, others=used,
                hint="every other slot runs a request or could not be kept: llama-server may erase one itself")
    return False


async def _held(generation: Generation) -> dict[int, Held]:
    """What each slot holds: as `/slots` says, for a slot a task ran in; for one none has (a slot restored at the
    start: `/slots` shows no tokens there, though it holds them all), as the book says."""
    book = book_of(generation)
    return {int(s["id"]): Held(int(s["n_prompt_tokens"]) if "n_prompt_tokens" in s else book.count(int(s["id"])),
                               bool(s.get("is_processing")))
            for s in await generation.client.slots()}


COMPACT_RESTORE_S = 0.1  # an idle slot is erased beside a decoding one only when bringing it back costs less


def compact_soon(generation: Generation, conv: Conversations, store: Store, slot: int, min_tokens: int) -> None:
    """A request is about to decode in `slot`: with one KV for every slot its attention spans the cells the other
    slots hold too (measured on the demo model: 16 tokens decoded in 650 ms beside an idle slot of 1.4k tokens, 450 ms
    beside an empty one). So each idle slot of `cache.min_tokens` or more whose conversation the store keeps but for
    less than `cache.min_tokens`, and whose restore is predicted under COMPACT_RESTORE_S, is kept whole and erased, in
    the background: its next turn restores it in milliseconds instead of every other turn decoding slower. A long
    conversation on a large model (a restore of seconds) stays in its slot."""
    if pool(generation) is None:
        return
    book, leases = book_of(generation), conv.leases
    per_token = conv.kv_per_token
    if per_token is None:
        return
    restore_bps = conv.rates_of(generation).rates.restore_bps or ASSUMED_RESTORE_BPS
    idle = [s for s, unkept in book.unkept().items() if s != slot and unkept < min_tokens <= book.count(s)
            and leases.free(s) and s not in leases.placed
            and book.count(s) * per_token / restore_bps < COMPACT_RESTORE_S]
    for victim in idle:
        leases.take(victim)
        conv.spawn(_compact(generation, conv, store, victim))


async def _compact(generation: Generation, conv: Conversations, store: Store, slot: int) -> None:
    try:
        if generation.alive:
            await take(generation, conv, store, slot, [], "idle beside a decoding slot (its cells slow its attention)")
    except Exception:  # a failed compaction costs speed, never the request
        log.exception("conversations.compact_failed", slot=slot)
    finally:
        conv.leases.let_go(slot, used=False)


def answer_room(limit: int | None) -> int:
    """The cells a request's answer may take: its max_tokens, else ANSWER_ROOM."""
    return limit if limit is not None else ANSWER_ROOM


def server_line(generation: Generation, line: str) -> bool:
    """llama-server's log: a slot it erased to make room (`purging slot`) is a loss the wrapper did not prevent."""
    found = _PURGED.search(line)
    if found is None:
        return True
    slot, tokens = int(found.group(1)), int(found.group(2))
    conv, book = state(generation), book_of(generation)
    lost = book.unkept().get(slot, tokens if book.partial(slot) else 0)
    conv.purged.append({"slot": slot, "tokens": tokens, "unkept": lost, "at": time.time()})
    METRICS.conv_purged.inc(lost)
    book.cut(slot, [], None)
    log.warning("conversations.purged", slot=slot, tokens=tokens, unkept=lost,
                hint="llama-server erased an idle slot to make room in the shared KV: what it held beyond what was "
                     "kept is read again at its next turn")
    return True
