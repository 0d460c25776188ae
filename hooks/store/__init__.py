"""Where saved states are kept: the interface (re-exported here), the slot folder and its layout, chunks, the
object store, the two tiers, and the one way a store is opened (hooks/store/opening.py)."""

from hooks.store.interface import (
    Entry,
    Forgotten,
    Noted,
    Store,
    Unavailable,
    Unreadable,
    best_of,
    common_prefix,
    key_of,
    owner_of,
)

__all__ = ["Entry", "Forgotten", "Noted", "Store", "Unavailable", "Unreadable", "best_of", "common_prefix", "key_of",
           "owner_of"]
