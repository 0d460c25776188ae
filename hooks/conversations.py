"""The conversation cache: every conversation comes back, not only the last one of each slot.

A step before each completion request (hooks/registry.py declares it) learns the request's tokens (the server's
own /apply-template and /tokenize), chooses the slot itself and pins the request to it (`id_slot`):
  - a slot that holds the start of this conversation, else an empty one, else the one whose conversation is
    cheapest to move out (the shortest, then the least recently used);
  - the conversation that slot holds leaves it: unless it was saved unchanged already, it is saved into the
    cache first (hooks/convstore.py), so nothing the server held is lost when it is overwritten;
  - the cached conversation sharing the longest prefix with the request is restored into the slot when it wins
    at least `slots.min_tokens` and its predicted restore time (bytes / measured restore rate) times
    `slots.restore_margin` is below the predicted prefill time (tokens / measured prefill rate); else the server
    prefills. Each decision is logged with both predictions (`conversations.decision`).
Rates are measured per model on this machine (prefill from the answers' timings, restores from their own time)
and kept in `~/.cache/llama-wrapper/rates/<model-id>.json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hooks import kvconvert, slotdir, slotfile
from hooks.compat import Mismatch, skip_reason
from hooks.convstore import Entry, Store, common_prefix, part_name
from hooks.slots import SLOTS, SlotSettings, convert_for, server_settings_of, state_of
from wrapper.generation import Generation, Host
from wrapper.llama import LlamaError
from wrapper.metrics import METRICS
from wrapper.proxy import Observer
from wrapper.server_help import cache_dir
from wrapper.steps import Outgoing

log = structlog.get_logger()

FAMILY = "conversations"
CHAT = ("/chat/completions", "/v1/chat/completions")
PATHS = ("/completion", "/completions", "/v1/completions", *CHAT)
OTHER_SLOT_USERS = ("/infill", "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking",
                    "/v1/rerank", "/v1/reranking")
EWMA = 0.3  # weight of the newest measurement in a rate
WAIT_FOR_SLOT_S = 600.0
RATES_EVERY_S = 10.0  # a learnt prefill rate is written to rates.json at most this often
_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_PROMPT_MS = re.compile(rb'"prompt_ms"\s*:\s*([0-9.eE+-]+)')


@dataclass
class Rates:
    """Measured on this machine for this model: prefill tokens per second, restore bytes per second."""

    prefill_tps: float | None = None
    restore_bps: float | None = None

    def learn_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:
            self.prefill_tps = _mix(self.prefill_tps, tokens / seconds)

    def learn_restore(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            self.restore_bps = _mix(self.restore_bps, nbytes / seconds)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class Conversations:
    """The cache's state for the wrapper's life (it outlives generations: a reload keeps it)."""

    rates: Rates = field(default_factory=Rates)
    rates_file: Path | None = None
    rates_saved: float = 0.0
    busy: set[int] = field(default_factory=set)  # slots with a request of ours in flight
    last_used: dict[int, float] = field(default_factory=dict)
    freed: asyncio.Event = field(default_factory=asyncio.Event)  # set when one of our requests ends
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=20))
    written: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=10_000))
    stores: dict[Path, Store] = field(default_factory=dict)  # one per folder: entries' tokens are read once
    hits: int = 0
    hits_by_entry: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)

    def bytes_written(self, within: float | None = None) -> int:
        since = time.time() - within if within is not None else 0.0
        return sum(n for at, n in self.written if at >= since)


def state(generation: Generation) -> Conversations:
    found = generation.shared.setdefault(FAMILY, Conversations())
    assert isinstance(found, Conversations)
    return found


def enabled(generation: Generation) -> bool:
    return SLOTS.of(generation.config).cache and isinstance(generation.launch.fitted.get(SLOTS.name), Path)


def _store(generation: Generation) -> Store:
    directory = generation.launch.fitted.get(SLOTS.name)
    assert isinstance(directory, Path)
    stores = state(generation).stores
    if directory not in stores:
        stores[directory] = Store(directory)
    return stores[directory]


# -- the step before a request -------------------------------------------------------------------------------


async def before(host: Host, out: Outgoing) -> Outgoing:
    generation = host.current
    if not enabled(generation) or out.payload is None:
        return out
    try:
        tokens = await _tokens(generation, out)
    except (LlamaError, ValueError, TypeError) as exc:
        log.debug("conversations.no_tokens", path=out.path, error=str(exc))
        _unpinned(generation)
        return out  # the server tokenizes it its own way; this request is not pinned
    conv, slots = state(generation), state_of(generation)
    _load_rates(generation, conv)
    if not slots.total_slots:
        with contextlib.suppress(LlamaError):
            slots.total_slots = int((await generation.client.props()).get("total_slots") or 1)
    asked = out.payload.get("id_slot")
    if isinstance(asked, int) and asked >= max(1, slots.total_slots):
        return out  # a slot the server does not have: it answers that itself
    slot = await _reserve(generation, conv, tokens, asked if isinstance(asked, int) and asked >= 0 else None)
    if slot is None:
        return out
    out.after.append(lambda status: _release(host, generation, conv, slot, tokens, status))
    try:
        await _make_room(generation, conv, slot, tokens)
        await _bring_back(generation, conv, slot, tokens)
    except Exception:  # a bug or a server error here must never fail the request: it is served, not pinned
        log.exception("conversations.internal_error", slot=slot)
    out.payload["id_slot"] = slot
    out.body = json.dumps(out.payload).encode()
    return out


async def _tokens(generation: Generation, out: Outgoing) -> list[int]:
    payload = out.payload
    assert payload is not None
    client = generation.client
    if out.path in CHAT:
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


async def _reserve(generation: Generation, conv: Conversations, tokens: list[int], asked: int | None) -> int | None:
    """The slot for this request, reserved until it is answered; waits while every slot serves one of ours (the
    server would queue it the same way, and then put it in a slot whose conversation nobody saved)."""
    held, total = state_of(generation).held, max(1, state_of(generation).total_slots)
    deadline = time.monotonic() + WAIT_FOR_SLOT_S
    while True:
        free = [s for s in range(total) if s not in conv.busy and (asked is None or s == asked)]
        if free:
            break
        if time.monotonic() > deadline:
            return None
        conv.freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conv.freed.wait(), timeout=5.0)
    shared = {s: common_prefix(held.get(s, []), tokens) for s in free}
    continuing = [s for s in free if shared[s] and shared[s] >= 0.5 * len(held.get(s, []))]
    if continuing:
        slot = max(continuing, key=lambda s: shared[s])
    else:  # an empty slot, else the one whose conversation is cheapest to move out (then the least recently used)
        slot = min(free, key=lambda s: (len(held.get(s, [])), conv.last_used.get(s, 0.0)))
    conv.busy.add(slot)
    return slot


def _release(host: Host, first: Generation, conv: Conversations, slot: int, tokens: list[int],
             status: int | None) -> None:
    """The request is answered (or cut). It ran on the generation it began on, and on the current one when a
    growth's reload sent it again there: the slot of each holds something new."""
    conv.busy.discard(slot)
    conv.last_used[slot] = time.monotonic()
    for generation in {id(g): g for g in (first, host.current)}.values():
        slots = state_of(generation)
        if status is not None and status < 400:
            slots.held[slot] = tokens  # and what it generated, which the next turn repeats
        else:
            slots.held.pop(slot, None)  # unknown now: it may hold part of it
        slots.dirty.add(slot)
        slots.pairs.pop(slot, None)
        slots.pinned = True
    conv.freed.set()


# -- a conversation leaves its slot ---------------------------------------------------------------------------


async def _make_room(generation: Generation, conv: Conversations, slot: int, tokens: list[int]) -> None:
    slots = state_of(generation)
    settings = SLOTS.of(generation.config)
    held = slots.held.get(slot, [])
    if len(held) < settings.min_tokens:
        return  # too short to keep
    if len(held) - common_prefix(held, tokens) < settings.min_tokens:
        return  # this request goes on with it (what it drops is too little to keep): it does not leave
    store = _store(generation)
    if slot not in slots.dirty and store.find(held) is not None:
        return  # unchanged since it came from the cache (or went into it): nothing new to write
    pair = slots.pairs.get(slot)
    if slot not in slots.dirty and pair is not None and _adopt(generation, store, slot, pair):
        return  # the slot file written at the last stop holds it: it becomes an entry, no byte written
    await save_slot(generation, slot, "it leaves its slot")


def _adopt(generation: Generation, store: Store, slot: int, pair: slotdir.SavedSlot) -> bool:
    """Move a slot's file into the cache as its entry (the slot is about to hold something else, so the file no
    longer says what it holds; the next save writes it anew)."""
    slots = state_of(generation)
    try:
        record = slotdir.read_sidecar(pair.sidecar)
        slotdir.check_pair(record, pair.kv_file)
        tokens = slots.held[slot]
        kept = {k: v for k, v in record.items() if k not in ("format", "slot", "file", "bytes", "fingerprint")}
        entry = store.commit(pair.kv_file, tokens, kept)
    except (slotdir.SidecarError, OSError, KeyError) as exc:
        log.info("conversations.adopt_failed", slot=slot, error=str(exc))
        return False
    with contextlib.suppress(OSError):
        pair.sidecar.unlink()  # it named the file that is an entry now
    slots.pairs.pop(slot, None)
    log.info("conversations.kept", slot=slot, tokens=entry.n_tokens, bytes=entry.bytes, from_file=pair.kv_file.name)
    return True


async def save_slot(generation: Generation, slot: int, why: str) -> Entry | None:
    """Save what a slot holds into the cache (unless it is there already); None when nothing was written."""
    conv, slots = state(generation), state_of(generation)
    settings = SLOTS.of(generation.config)
    store = _store(generation)
    store.sweep()
    if store.free_bytes() < settings.cache_min_free:
        _skip(slot, f"less than slots.cache_min_free ({settings.cache_min_free >> 20} MiB) is free on disk")
        return None
    held = slots.held.get(slot, [])
    part = store.directory / part_name(f"{len(held):016x}")
    began = time.monotonic()
    try:
        answer = await generation.client.slot_action(slot, "save", part.name)
        if int(answer.get("n_saved", 0)) < settings.min_tokens:
            return None
        header = slotfile.read(part)
        slots.held[slot] = header.tokens
        slots.dirty.discard(slot)
        if (known := store.find(header.tokens)) is not None:
            store.touch(known)
            return None  # the cache has it already: nothing new is written
        if header.bytes > min(settings.cache_entry_max, settings.cache_budget):
            _skip(slot, f"{header.bytes >> 20} MiB is more than slots.cache_entry_max or slots.cache_budget")
            return None
        record = {k: v for k, v in (await server_settings_of(generation)).items()
                  if k in ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "kv_unified", "kv_streams",
                           "total_slots", "n_ctx", "attn_rot_disable", "build")}
        record.update(model=generation.launch.model.as_dict(), state_version=header.version,
                      saved_at=time.time())
        entry = store.commit(part, header.tokens, record)
    except (LlamaError, slotfile.SlotFileError, OSError) as exc:
        log.warning("conversations.save_failed", slot=slot, error=str(exc))
        return None
    finally:
        with contextlib.suppress(OSError):
            part.unlink()
    conv.written.append((time.time(), entry.bytes))
    METRICS.conv_bytes_written.inc(entry.bytes)
    evicted = store.evict(settings.cache_budget, keep={entry.key})
    log.info("conversations.saved", slot=slot, why=why, tokens=entry.n_tokens, bytes=entry.bytes,
             ms=round((time.monotonic() - began) * 1000, 1), evicted=[e.key for e in evicted])
    return entry


def _skip(slot: int, reason: str) -> None:
    log.warning("conversations.save_skipped", slot=slot, reason=reason)


# -- a conversation comes back --------------------------------------------------------------------------------


async def _bring_back(generation: Generation, conv: Conversations, slot: int, tokens: list[int]) -> None:
    settings = SLOTS.of(generation.config)
    slots = state_of(generation)
    store = _store(generation)
    entry, shared = store.best(tokens)
    in_slot = common_prefix(slots.held.get(slot, []), tokens)
    if entry is None or shared <= in_slot:
        _miss(conv, "not cached" if entry is None or shared == 0 else "the slot holds as much")
        return
    gain = shared - in_slot
    restore_s, prefill_s = _predict(conv, settings, entry.bytes, gain)
    pays = gain >= settings.min_tokens and (prefill_s is None or restore_s * settings.restore_margin < prefill_s)
    why = (f"wins {gain} tokens" if pays else f"only {gain} tokens (slots.min_tokens {settings.min_tokens})"
           if gain < settings.min_tokens else "a prefill is quicker")
    decision = {"slot": slot, "entry": entry.key, "entry_tokens": entry.n_tokens, "shared": shared,
                "in_slot": in_slot, "choice": "restore" if pays else "prefill", "why": why,
                "predicted_restore_s": round(restore_s, 3),
                "predicted_prefill_s": round(prefill_s, 3) if prefill_s is not None else None}
    conv.decisions.append({"at": time.time(), **decision})
    log.info("conversations.decision", **decision)
    if not pays:
        _miss(conv, "a prefill is quicker" if gain >= settings.min_tokens else "too little to win")
        return
    usable = await _usable(generation, store, entry, slot)
    if usable is not None:
        await _restore(generation, conv, store, usable, slot)


async def _usable(generation: Generation, store: Store, entry: Entry, slot: int) -> Entry | None:
    """The entry as this server can restore it: checked like a slot file, converted when only the cache types
    differ (a reload or a rung changed them); None (a prefill) when it cannot be used, with the reason."""
    settings = await server_settings_of(generation)
    try:
        header = slotfile.read(entry.kv_file)
    except slotfile.SlotFileError as exc:
        _skip_entry(generation, store, entry, f"unreadable: {exc}", remove=True)
        return None
    skip = skip_reason(slot, entry.record, header, generation.launch.model.id, settings, None)
    if skip is None:
        return entry
    if skip.kind is not Mismatch.CACHE_TYPES:
        _skip_entry(generation, store, entry, skip.reason, remove=False)
        return None
    part = store.directory / part_name(entry.key)
    try:
        done = await asyncio.to_thread(convert_for, generation, entry.kv_file, part, settings)
        converted = slotfile.read(part)
        record = {**{k: v for k, v in entry.record.items() if k not in ("format", "file", "bytes", "fingerprint")},
                  "cache_type_k": settings["cache_type_k"], "cache_type_v": settings["cache_type_v"],
                  "attn_rot_disable": settings["attn_rot_disable"]}
        fresh = store.commit(part, converted.tokens, record)
    except (kvconvert.NotConvertible, slotfile.SlotFileError, OSError) as exc:
        _skip_entry(generation, store, entry, f"not converted: {exc}", remove=False)
        return None
    finally:
        with contextlib.suppress(OSError):
            part.unlink()
    log.info("conversations.converted", entry=entry.key, ms=round(done.seconds * 1000, 1),
             to=f"{settings['cache_type_k']}/{settings['cache_type_v']}")
    return fresh


def _skip_entry(generation: Generation, store: Store, entry: Entry, reason: str, remove: bool) -> None:
    _miss(state(generation), "not usable")
    log.info("conversations.entry_skipped", entry=entry.key, reason=reason, removed=remove)
    if remove:
        store.remove(entry)


def _predict(conv: Conversations, settings: SlotSettings, nbytes: int, gain: int) -> tuple[float, float | None]:
    rate = settings.restore_rate or conv.rates.restore_bps or 1e9  # 1 GB/s until measured
    prefill = gain / conv.rates.prefill_tps if conv.rates.prefill_tps else None
    return nbytes / rate, prefill


async def _restore(generation: Generation, conv: Conversations, store: Store, entry: Entry, slot: int) -> None:
    began = time.monotonic()
    try:
        answer = await generation.client.slot_action(slot, "restore", entry.kv_file.name)
    except LlamaError as exc:
        log.warning("conversations.restore_failed", slot=slot, entry=entry.key, error=str(exc))
        _miss(conv, "the server refused it")
        return
    seconds = time.monotonic() - began
    conv.rates.learn_restore(entry.bytes, seconds)
    _save_rates(conv)
    slots = state_of(generation)
    slots.held[slot] = entry.tokens
    slots.dirty.discard(slot)
    slots.pairs.pop(slot, None)
    store.touch(entry)
    conv.hits += 1
    conv.hits_by_entry[entry.key] = conv.hits_by_entry.get(entry.key, 0) + 1
    METRICS.conv_lookups.labels(result="hit", reason="restored").inc()
    log.info("conversations.restored", slot=slot, entry=entry.key, tokens=int(answer.get("n_restored") or 0),
             bytes=entry.bytes, ms=round(seconds * 1000, 1))


def _miss(conv: Conversations, reason: str) -> None:
    conv.misses[reason] = conv.misses.get(reason, 0) + 1
    METRICS.conv_lookups.labels(result="miss", reason=reason).inc()


# -- rates, what the wrapper reports -----------------------------------------------------------------------------


def observer(generation: Generation) -> Observer | None:
    if not enabled(generation):
        return None
    conv = state(generation)
    _load_rates(generation, conv)

    def seen(path: str, status: int, tail: bytes) -> None:
        if path in OTHER_SLOT_USERS:
            _unpinned(generation)  # it ran in some slot the wrapper did not choose
        if status != 200:
            return
        tokens, ms = _PROMPT_N.findall(tail), _PROMPT_MS.findall(tail)
        if tokens and ms:
            conv.rates.learn_prefill(int(tokens[-1]), float(ms[-1]) / 1000)
            if time.monotonic() - conv.rates_saved > RATES_EVERY_S:
                _save_rates(conv)

    return seen


def _unpinned(generation: Generation) -> None:
    """A request the server put in a slot of its choosing: any slot may hold something else now."""
    slots = state_of(generation)
    slots.dirty.update(range(max(1, slots.total_slots, *(s + 1 for s in slots.held))))
    slots.held.clear()


def rates_dir() -> Path:
    """Where the measured rates are kept per model (this machine's cache, not the shared slot folder)."""
    return cache_dir().parent / "rates"


def _load_rates(generation: Generation, conv: Conversations) -> None:
    if conv.rates_file is not None:
        return
    conv.rates_file = rates_dir() / f"{generation.launch.model.id}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        conv.rates = Rates(**json.loads(conv.rates_file.read_text()))


def _save_rates(conv: Conversations) -> None:
    if conv.rates_file is None:
        return
    conv.rates_saved = time.monotonic()
    temporary = conv.rates_file.with_name(f"{conv.rates_file.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        conv.rates_file.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(asdict(conv.rates)))
        os.replace(temporary, conv.rates_file)


def metrics(generation: Generation) -> None:
    if enabled(generation):
        entries = _store(generation).entries()
        METRICS.conv_entries.set(len(entries))
        METRICS.conv_bytes.set(sum(e.bytes for e in entries))


def status(generation: Generation) -> dict[str, Any]:
    if not enabled(generation):
        return {"on": False}
    conv = state(generation)
    entries = sorted(_store(generation).entries(), key=lambda e: e.last_used, reverse=True)
    total = sum(e.bytes for e in entries)
    METRICS.conv_entries.set(len(entries))
    METRICS.conv_bytes.set(total)
    return {
        "on": True, "entries": [{**e.as_dict(), "hits": conv.hits_by_entry.get(e.key, 0)} for e in entries[:50]],
        "count": len(entries), "bytes": total,
        "budget": SLOTS.of(generation.config).cache_budget,
        "rates": {"prefill_tokens_per_s": conv.rates.prefill_tps, "restore_bytes_per_s": conv.rates.restore_bps},
        "hits": conv.hits, "misses": dict(conv.misses), "decisions": list(conv.decisions),
        "bytes_written": {"total": conv.bytes_written(), "last_hour": conv.bytes_written(3600)},
    }
