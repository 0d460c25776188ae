"""What the conversation cache reports (status, /metrics) and learns from proxied answers (the prefill rate,
requests the server put in a slot of its own choosing)."""

from __future__ import annotations

import re
from typing import Any

from hooks.conversations.state import enabled, state
from hooks.slots.book import book_of
from hooks.slots.stores import store_of
from hooks.store import Store
from hooks.store.settings import STORE
from wrapper.configuration import consumers
from wrapper.configuration.consumers import ANONYMOUS, CONSUMERS
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation
from wrapper.steps import Observer

_PROMPT_N = re.compile(rb'"prompt_n"\s*:\s*(\d+)')
_PROMPT_MS = re.compile(rb'"prompt_ms"\s*:\s*([0-9.eE+-]+)')


def observer(generation: Generation) -> Observer | None:
    if not enabled(generation):
        return None
    conv = state(generation)
    kept = conv.rates_of(generation)

    def seen(path: str, status: int, tail: bytes) -> None:
        if status != 200:
            return
        tokens, ms = _PROMPT_N.findall(tail), _PROMPT_MS.findall(tail)
        if tokens and ms:
            kept.rates.learn_prefill(int(tokens[-1]), float(ms[-1]) / 1000)
            kept.save(soon=True)

    return seen


def metrics(generation: Generation) -> None:
    store = store_of(generation)
    if enabled(generation) and store is not None:
        METRICS.conv_entries.set(len(store.entries()))
        METRICS.conv_bytes.set(store.used_bytes())
        METRICS.conv_unkept.set(sum(book_of(generation).unkept().values()))
        for name, kept in _kept_by_consumer(generation, store).items():
            for tier in ("folder", "bucket"):
                METRICS.consumer_bytes.labels(consumer=name, tier=tier).set(kept[f"{tier}_bytes"])


def _kept_by_consumer(generation: Generation, store: Store) -> dict[str, dict[str, int]]:
    """What each consumer has kept (`consumers:`), per tier: its entries and their sizes; {} without consumers."""
    settings = CONSUMERS.of(generation.config)
    if not consumers.on(settings):
        return {}
    names = [*consumers.named(settings), ANONYMOUS]
    kept = {name: {"entries": 0, "folder_bytes": 0, "bucket_bytes": 0} for name in names}
    folder, bucket = store.in_tiers()
    for entry in store.entries():
        if entry.named is None:
            continue
        counts = kept.setdefault(entry.named, {"entries": 0, "folder_bytes": 0, "bucket_bytes": 0})
        counts["entries"] += 1
        counts["folder_bytes"] += entry.bytes if entry.key in folder else 0
        counts["bucket_bytes"] += entry.bytes if entry.key in bucket else 0
    return kept


def consumers_status(generation: Generation, store: Store) -> dict[str, Any] | None:
    """Per consumer, by name (never its key): what it kept and its counts; None without consumers."""
    kept = _kept_by_consumer(generation, store)
    if not kept:
        return None
    settings = CONSUMERS.of(generation.config)
    return {"isolate": consumers.isolating(settings),
            "shared_prefix_tokens": len(state(generation).public.tokens) if settings.shared_prefix else None,
            "by_name": {name: {**counts, **METRICS.tally(name).as_dict(),
                               **({"share": share.shown()} if (share := consumers.share_of(settings, name)).shown()
                                  else {})}
                        for name, counts in kept.items()}}


def status(generation: Generation) -> dict[str, Any]:
    store = store_of(generation)
    if not enabled(generation) or store is None:
        return {"on": False}
    conv = state(generation)
    rates = conv.rates_of(generation).rates
    entries = sorted(store.entries(), key=lambda e: e.last_used, reverse=True)
    total = store.used_bytes()  # on disk here, each chunk once
    METRICS.conv_entries.set(len(entries))
    METRICS.conv_bytes.set(total)
    book = book_of(generation)
    at_risk = sum(book.unkept().values())
    METRICS.conv_unkept.set(at_risk)
    return {
        "on": True, "entries": [{**e.as_dict(), "hits": conv.hits_by_entry.get(e.key, 0)} for e in entries[:50]],
        "count": len(entries), "bytes": total,
        "budget": STORE.of(generation.config).budget,
        "rates": {"prefill_tokens_per_s": rates.prefill_tps, "restore_bytes_per_s": rates.restore_bps,
                  "convert_bytes_per_s": rates.convert_bps},
        "unkept_tokens": at_risk, "untracked_slots": book.untracked(),
        "hits": conv.hits, "misses": dict(conv.misses), "continued": conv.continued, "decisions": list(conv.decisions),
        "checkpoints": {**conv.checkpoints, "stall_s": round(conv.stall_s, 3)},
        "purged": {"count": len(conv.purged), "unkept_tokens": sum(p["unkept"] for p in conv.purged),
                   "last": list(conv.purged)[-5:]},
        "bytes_written": {"total": conv.bytes_written(), "last_hour": conv.bytes_written(3600)},
        **({"consumers": by} if (by := consumers_status(generation, store)) is not None else {}),
    }
