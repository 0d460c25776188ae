"""A consumer's own view (`GET /wrapper/conversations`): what the cache keeps for it — each entry's tokens, bytes,
last use and tiers, and the slots holding its conversations now — and nothing of anyone else's."""

from __future__ import annotations

from typing import Any

from hooks.conversations.forget import unanswerable
from hooks.conversations.state import counted
from hooks.slots.stores import store_of
from wrapper.configuration import consumers
from wrapper.server.generation import Host


async def listing(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The route's handler: `body["consumer"]`, the name the endpoint resolved from the key (or the admin's ask).
    Its entries of every `cache_salt` are its own, each shown with `salted: true` (never the salt)."""
    generation = host.current
    consumer = str(body.get("consumer") or "")
    if (refusal := unanswerable(generation, consumer)) is not None:
        return refusal
    store = store_of(generation)
    assert store is not None
    folder, bucket = store.in_tiers()
    theirs = sorted((e for e in store.entries() if e.named == consumer), key=lambda e: -e.last_used)
    entries = [{"key": entry.key, "tokens": entry.n_tokens, "bytes": entry.bytes,
                "last_used": round(entry.last_used, 3),
                "tiers": [tier for tier, keys in (("folder", folder), ("bucket", bucket)) if entry.key in keys],
                **({"salted": True} if consumers.is_salted(entry.consumer) else {})} for entry in theirs]
    slots: list[int] = []
    if generation.alive:
        book = await counted(generation)
        slots = [slot for slot in range(book.total)
                 if (owner := book.owner_of(slot)) is not None and consumers.name_of(owner) == consumer]
    return 200, {"consumer": consumer, "entries": entries, "tokens": sum(e.n_tokens for e in theirs),
                 "bytes": sum(e.bytes for e in theirs), "slots": slots}
