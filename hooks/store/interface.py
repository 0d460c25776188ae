"""Where saved slot states are kept: the interface. Two stores have it: the model's slot folder
(hooks/store/folder.py), and that folder in front of an object store (hooks/store/tiered.py); hooks/store/opening.py
opens the one the config names. Nothing outside the store package asks which one it has.

Every saved state is an entry named by what it holds (a hash of its tokens), whoever saved it and why (a
conversation that left its slot, a slot saved at a stop or before a reload). What each slot of a host held at
its last stop is that host's note: slot -> entry key. Nothing outside a store names a file of it: llama-server
writes a state into a part the store hands out, and restores from a local path the store makes readable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from wrapper.configuration.consumers import name_of, share_for


class Unreadable(Exception):
    """An entry the store cannot hand over whole (damaged, half-written, gone)."""


class Unavailable(Exception):
    """An entry the store cannot hand over now (a full disk, the bucket down or slow): not the entry's fault."""


class Forgotten(Exception):
    """A commit refused: the state was taken from its slot before its consumer was forgotten (a save that raced the
    forget); nothing of it is left."""


def key_of(tokens: list[int], owner: str | None = None, secret: str | None = None) -> str:
    """An entry's key: a hash of its tokens, and of its owner when it is private to one consumer (two consumers'
    same conversation are two entries), keyed by `secret` when the store seals what it uploads (store.encrypt: a
    guessed conversation's key cannot be computed)."""
    words = np.asarray(tokens, dtype="<i4").tobytes()
    salt = (f"{owner}\0" if owner is not None else "") + (f"{secret}\0" if secret is not None else "")
    return hashlib.sha256(salt.encode() + words if salt else words).hexdigest()[:16]


def owner_of(record: dict[str, Any]) -> str | None:
    """The consumer an entry is private to (its key and chunks are named with it), from its sidecar record; None: an
    entry any lookup may find (consumers not isolated, or written before they were)."""
    consumer = record.get("consumer")
    return str(consumer) if record.get("private") and isinstance(consumer, str) and consumer else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if len(differ) else n


def best_of(entries: list[Entry], tokens: list[int]) -> tuple[Entry | None, int]:
    """The entry sharing the longest prefix with `tokens` (the shorter of two that share as much), and how long
    that prefix is; entries whose tokens cannot be read are passed over."""
    best: Entry | None = None
    length = 0
    for entry in entries:
        try:
            shared = common_prefix(entry.tokens, tokens)
        except Unreadable:
            continue
        if shared > length or (shared == length and best is not None and entry.n_tokens < best.n_tokens):
            best, length = entry, shared
    return best, length


@dataclass
class Entry:
    key: str
    n_tokens: int
    bytes: int
    last_used: float  # seconds since the epoch
    record: dict[str, Any]  # what the saver knew: model, cache types, state version, ...
    name: str  # what status and `slots ls` show
    by_content: bool = True  # False: a pair of the earlier layout, named by its slot (never found by a lookup)
    load_tokens: Callable[[], list[int]] = field(repr=False, default=list)
    _tokens: list[int] | None = field(default=None, repr=False)
    written: int = 0  # the bytes its commit wrote (only what the store did not hold: new chunks, tail, manifest)
    problem: str | None = None  # why its sidecar cannot be used (an entry asked for by key: a note names it)

    @property
    def tokens(self) -> list[int]:
        """Its token ids, read once (Unreadable when they cannot be)."""
        if self._tokens is None:
            self._tokens = self.load_tokens()
        return self._tokens

    @property
    def consumer(self) -> str | None:
        """Whose conversation it is (`consumers:`), as its saver knew; None: not told."""
        consumer = self.record.get("consumer")
        return consumer if isinstance(consumer, str) else None

    @property
    def named(self) -> str | None:
        """The consumer it is counted for (its `cache_salt` left out): what the status, /metrics and shares say."""
        return name_of(self.consumer) if self.consumer is not None else None

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "tokens": self.n_tokens, "bytes": self.bytes, "file": self.name,
                "last_used": round(self.last_used, 3),
                **({"consumer": self.consumer} if self.consumer is not None else {})}


@dataclass(frozen=True)
class Shares:
    """What each consumer may keep, in bytes, per tier (`consumers.shares`): consumer -> bytes."""

    folder: Mapping[str, int] = field(default_factory=dict)
    bucket: Mapping[str, int] = field(default_factory=dict)


def held_within(entries: list[Entry], shares: Mapping[str, int], keep: set[str]) -> list[Entry]:
    """The entries to remove so that each consumer keeps within its share: its oldest first (never one of `keep`). A
    consumer's conversations of every `cache_salt` count together; each user of a front-end (`open-webui/42`) is held
    to its front-end's share on its own."""
    going = []
    held: dict[str, list[Entry]] = {}
    for entry in entries:
        if entry.named is not None:
            held.setdefault(entry.named, []).append(entry)
    for consumer, theirs in held.items():
        share = share_for(shares, consumer)
        if share is None:
            continue
        mine = sorted(theirs, key=lambda e: e.last_used)
        total = sum(e.bytes for e in mine)
        for entry in mine:
            if total <= share:
                break
            if entry.key not in keep:
                going.append(entry)
                total -= entry.bytes
    return going


@dataclass(frozen=True)
class Noted:
    """One slot of a host's note: the entry it held at that host's last stop (None: that entry is gone)."""

    slot: int
    key: str
    n_tokens: int
    entry: Entry | None


class Store(Protocol):
    """Lookups answer from what the store last saw; a store looks again on its own terms (a changed folder,
    a maximum age), never once per request."""

    @property
    def directory(self) -> Path:
        """The model's slot folder (llama-server's --slot-save-path)."""
        ...

    def entries(self) -> list[Entry]:
        """Every committed entry (other hosts' too, as of the last look)."""
        ...

    def get(self, key: str) -> Entry | None:
        """The entry of that key if it is still there (checked now, not from the last look)."""
        ...

    def best(self, tokens: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and how long that prefix is."""
        ...

    def find(self, tokens: list[int], owner: str | None = None) -> Entry | None:
        """The entry holding exactly these tokens (private to `owner`, when one is given: key_of)."""
        ...

    def part(self, what: str) -> AbstractContextManager[Path]:
        """A path in the slot folder for llama-server to write a state into (its name for the save action);
        no reader looks at it, and it is removed when the block ends unless committed."""
        ...

    def commit(self, written: Path, tokens: list[int], record: dict[str, Any]) -> Entry:
        """Make a verified part an entry; the entries it extends (shorter states of it) go."""
        ...

    def touch(self, entry: Entry) -> None:
        """A hit: its last use is now."""
        ...

    def evict(self, budget: int, keep: set[str] | None = None, shares: Shares | None = None) -> list[Entry]:
        """Remove the least recently used entries until the rest fit `budget` bytes: with `shares`, first each
        consumer's oldest while it is over its folder share, then those of consumers without a share before those
        within theirs (a store behind keeps each within its bucket share at its next upload)."""
        ...

    def remove(self, entry: Entry) -> None: ...

    def set_aside(self, entry: Entry, reason: str) -> str:
        """Keep an entry that made llama-server fail out of every lookup, with why; says where it went."""
        ...

    async def fetch(self, entry: Entry) -> Entry:
        """The entry brought into the local tier, so that `local` can hand it over (itself when it is there; a
        longer state of its conversation when another host replaced it with that one meanwhile); Unreadable when it
        cannot be fetched."""
        ...

    def local(self, entry: Entry) -> AbstractAsyncContextManager[Path]:
        """The entry, whole, as a file in llama-server's slot folder (its name for the restore action) for the
        block's length; Unreadable when it cannot be."""
        ...

    def fetch_seconds(self, entry: Entry) -> float:
        """The predicted time `local` takes before a restore can begin (0 for an entry on local disk)."""
        ...

    def problem(self, entry: Entry) -> str | None:
        """What is wrong with the entry as this host holds it (its files are not what its sidecar says, a chunk
        is missing or cut, its chunk names are not its tokens'); None when it is sound or only another tier has
        it. Reads its files: for `slots ls`, not for a request."""
        ...

    async def forget_consumer(self, consumer: str) -> dict[str, Any]:
        """Remove every entry of that consumer from every tier (their chunks no other entry names at once, the
        notes' lines naming them); what went, per tier (`bucket` None without one). Behind a bucket, a tombstone
        tells every other host to do the same at its next look; BucketError when the bucket could not be told."""
        ...

    def forgotten(self) -> dict[str, float]:
        """consumer -> when what it kept was last forgotten (here, or by another host on the bucket)."""
        ...

    def free_bytes(self) -> int: ...

    def used_bytes(self) -> int:
        """What the entries take (each chunk counted once)."""
        ...

    def sweep(self) -> list[str]:
        """Remove what dead writers left; says what went."""
        ...

    def held(self, host: str) -> list[Noted]:
        """What each slot held at that host's last stop (another host's latest when it has none)."""
        ...

    def note(self, host: str, slots: dict[int, Entry]) -> bool:
        """Record what each slot of `host` holds now (slots not given keep what the note said); False when the
        note already says so."""
        ...

    # -- the tiers: the folder alone answers these as a store with nothing behind it ---------------------------

    @property
    def behind(self) -> str | None:
        """The tier behind the folder (its URL and endpoint), None when the folder is the whole store."""
        ...

    def in_tiers(self) -> tuple[set[str], set[str]]:
        """The keys the folder holds, and those the tier behind holds (none without one), as of the last look."""
        ...

    def where(self, entry: Entry) -> str:
        """`local`, `store` or `both`: which tiers hold the entry (`gone` when none does any more)."""
        ...

    async def first_look(self, within: float) -> None:
        """At a start: learn what the tier behind holds, if it answers within `within` seconds."""
        ...

    async def background(self) -> None:
        """From ready until the stop: keep the tiers in step (never returns while there is a tier behind)."""
        ...

    async def flush(self, budget_s: float) -> dict[str, Any] | None:
        """At a drain or a stop: hand what only the folder holds to the tier behind, for at most `budget_s`; what
        went and what did not (None without a tier behind)."""
        ...

    def status(self) -> dict[str, Any] | None:
        """Per tier: entries, bytes, the state of the tier behind; None without a tier behind."""
        ...

    def metrics(self) -> None:
        """Set the store's gauges before a scrape (none without a tier behind)."""
        ...
