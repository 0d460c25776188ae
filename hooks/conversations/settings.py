"""The conversation cache's section of the config (`cache:`), on with the slot built-ins. Its keys were
`slots.cache`, `slots.min_tokens`, `slots.restore_margin` and `slots.restore_rate` (hooks/slots/settings.py's
MOVED), and what the folder may hold moved on to the store's section (`store.budget`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.store.settings import MOVED_FROM_CACHE
from wrapper.configuration.settings import BOOL, COUNT, FRACTION, NUMBER, SIZE_OR_AUTO, Section, setting


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool = setting(True, BOOL, "pin requests to slots, keep every conversation that leaves a slot on disk "
                            "and restore it when it comes back (with `slots.restore`)")
    min_tokens: int = setting(256, COUNT, "shorter conversations are not kept, and a restore must win this many "
                              "tokens over what the slot holds")
    restore_margin: float = setting(1.2, NUMBER, "restore when the predicted restore time times this is below "
                                    "the predicted prefill time")
    restore_rate: int | None = setting(None, SIZE_OR_AUTO, "bytes per second a restore reads (`auto`: measured; "
                                       "give one for a slow disk)")
    checkpoint_tokens: int = setting(1024, COUNT, "a conversation still in its slot is kept again once it grew by "
                                     "this many tokens (its answers included) since it was last kept: right after "
                                     "the answer that grew it (within `cache.checkpoint_share`), else once no "
                                     "request has been in flight for 2s. A crash then costs at most the prefill of "
                                     "this many tokens and the turn under way (0: kept only when it leaves its slot, "
                                     "and at a stop)")
    checkpoint_share: float = setting(0.05, FRACTION, "the most of a busy server's time the checkpoints taken right "
                                      "after an answer may hold llama-server's loop (a save stops every slot's "
                                      "decoding while it writes): after one that held it t seconds, the next waits "
                                      "t / this (0: checkpoints only after 2s of quiet)")


CACHE = Section("cache", CacheSettings, "the conversation cache", moved=MOVED_FROM_CACHE)
