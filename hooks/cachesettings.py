"""The conversation cache's section of the config (`cache:`), on with the slot built-ins. Its keys were
`slots.cache*`, `slots.min_tokens`, `slots.restore_margin` and `slots.restore_rate`: those now fail with the
name of the new key (hooks/slots/actions.py's MOVED)."""

from __future__ import annotations

from dataclasses import dataclass

from wrapper.settings import BOOL, COUNT, NUMBER, SIZE, SIZE_OR_AUTO, Section, setting


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = setting(True, BOOL, "pin requests to slots, keep every conversation that leaves a slot on disk "
                            "and restore it when it comes back (with `slots.restore`)")
    budget: int = setting(20 << 30, SIZE, "its size on disk: the least recently used conversations go first")
    entry_max: int = setting(4 << 30, SIZE, "a conversation larger than this is not kept")
    min_free: int = setting(2 << 30, SIZE, "no conversation is written when less than this is free on disk")
    min_tokens: int = setting(256, COUNT, "shorter conversations are not kept, and a restore must win this many "
                              "tokens over what the slot holds")
    restore_margin: float = setting(1.2, NUMBER, "restore when the predicted restore time times this is below "
                                    "the predicted prefill time")
    chunk_tokens: int = setting(256, COUNT, "a conversation is kept as chunks of this many tokens, each written "
                                "once: a new turn writes only the chunks it adds, and conversations with the same "
                                "beginning share it (0: each state whole)")
    restore_rate: int | None = setting(None, SIZE_OR_AUTO, "bytes per second a restore reads (`auto`: measured; "
                                       "give one for a slow disk)")


CACHE = Section("cache", CacheSettings, "the conversation cache")
MOVED = {"cache": "cache.enabled", "cache_budget": "cache.budget", "cache_entry_max": "cache.entry_max",
         "cache_min_free": "cache.min_free", "min_tokens": "cache.min_tokens",
         "restore_margin": "cache.restore_margin", "restore_rate": "cache.restore_rate"}  # slots.<key> ->
