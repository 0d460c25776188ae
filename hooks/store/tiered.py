"""The store as two tiers: the model's slot folder (hot, hooks/store/folder.py) in front of an object store
(`store.url`, hooks/store/remote.py).

Everything is committed to the folder first, as without a bucket; what was committed is uploaded in the
background (`background`, from ready until the stop), and a drain or a stop uploads what is left within
`store.flush` (`flush`). Lookups answer from the folder and from the bucket's manifests as of the last
look, which is taken again every `store.refresh`: never a listing per request. An entry only the bucket
holds is fetched into the folder when a restore wants it (`fetch`), and the fetch's measured rate is part of
the restore-or-prefill rule (`fetch_seconds`): a slow bucket is prefilled past.

The bucket failing (down, slow, 5xx, 403) never fails a request: the folder serves, a fetch that fails is a
prefill, and the log says so once per change of state (`store.down`, `store.up`); the sync retries with a
backoff, and uploads resume where they stopped (what the folder holds and the bucket does not is pending).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hooks.store import threads
from hooks.store.bucket import BucketError, NotFound
from hooks.store.folder import DirectoryStore
from hooks.store.interface import Entry, Noted, Shares, Unavailable, Unreadable, best_of, held_within
from hooks.store.remote import PARALLEL, Remote
from hooks.store.sealing import WrongKey
from wrapper.metrics import METRICS

log = structlog.get_logger()

ASSUMED_FETCH_BPS = 50e6  # until a fetch is measured
ASSUMED_OBJECT_S = 0.02  # a request's round trip, until measured
FETCH_MIN_S, FETCH_MARGIN = 10.0, 4.0  # a fetch is given this long at least, or this many times its prediction
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
HOUR_S = 3600.0


@dataclass
class Counters:
    uploads: int = 0
    uploaded: int = 0  # bytes
    fetches: int = 0
    fetched: int = 0
    errors: int = 0
    fetch_bps: float | None = None
    object_s: float | None = None
    log: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=10_000))  # at, written, sent

    def last_hour(self, index: int) -> int:
        since = time.time() - HOUR_S
        return sum(int(item[index]) for item in self.log if item[0] >= since)


class TieredStore:
    def __init__(self, folder: DirectoryStore, remote: Remote, host: str, refresh_s: float = 5.0) -> None:
        self.folder, self.remote, self.host = folder, remote, host
        self.refresh_s = refresh_s
        self.pending: dict[str, Entry] = {}  # committed here, not yet in the bucket, oldest first
        self.refused: set[str] = set()  # bucket entries that proved unusable: not offered again
        self.counters = Counters()
        self.state = "unknown"  # "up" or "down" once the bucket answered or failed
        self.error: str | None = None
        self.looked_at: float | None = None  # when the manifests were last read (monotonic)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reconciled = False
        self._busy: asyncio.Lock | None = None  # one listing or upload round at a time (the sync, a flush)
        self.forgotten_at: dict[str, float] = {}  # consumer -> when what it kept was forgotten (here or by another)
        self.bucket_shares: dict[str, int] = {}  # consumer -> the bytes it may keep in the bucket (the last evict's)
        self.key_checked = True  # store.encrypt: the bucket is known to be sealed with this key (or nothing is)

    # -- lookups ---------------------------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        here = self.folder.entries()
        keys = {e.key for e in here}
        return here + [k.entry() for k in list(self.remote.index.values())
                       if k.key not in keys and k.key not in self.refused]

    def get(self, key: str) -> Entry | None:
        found = self.folder.get(key)
        if found is not None:
            return found
        known = self.remote.index.get(key)
        return known.entry() if known is not None and key not in self.refused else None

    def best(self, tokens: list[int]) -> tuple[Entry | None, int]:
        return best_of(self.entries(), tokens)

    def find(self, tokens: list[int], owner: str | None = None) -> Entry | None:
        found = self.folder.find(tokens, owner)
        if found is not None:
            return found
        known = self.remote.index.get(self.folder.key_for(tokens, owner))
        return known.entry() if known is not None and len(known.tokens) == len(tokens) else None

    def held(self, host: str) -> list[Noted]:
        """The host's note, its keys resolved in both tiers (a save may have found a state in the bucket only)."""
        return [h if h.entry is not None else Noted(h.slot, h.key, h.n_tokens, self.get(h.key))
                for h in self.folder.held(host)]

    @property
    def directory(self) -> Path:
        return self.folder.directory

    @property
    def behind(self) -> str:
        return self.remote.describe()

    def where(self, entry: Entry) -> str:
        remote = entry.key in self.remote.index
        if self.folder.get(entry.key) is None:
            return "store" if remote else "gone"
        return "both" if remote and entry.key not in self.pending else "local"

    # -- writes ----------------------------------------------------------------------------------------------

    def part(self, what: str) -> AbstractContextManager[Path]:
        return self.folder.part(what)

    def commit(self, written: Path, tokens: list[int], record: dict[str, Any]) -> Entry:
        entry = self.folder.commit(written, tokens, record)
        self.pending.pop(entry.key, None)
        self.pending[entry.key] = entry
        self.counters.log.append((time.time(), entry.written, 0))
        self._poke()
        return entry

    def touch(self, entry: Entry) -> None:
        if self.folder.get(entry.key) is not None:
            self.folder.touch(entry)

    def evict(self, budget: int, keep: set[str] | None = None, shares: Shares | None = None) -> list[Entry]:
        kept = (keep or set()) | set(self.pending)  # the only copy is never evicted
        if not self._reconciled:  # the bucket not read yet: what it lacks is not known either
            kept |= {e.key for e in self.folder.entries() if e.key not in self.remote.index}
        if shares is not None:
            self.bucket_shares = dict(shares.bucket)
        return self.folder.evict(budget, kept, shares)

    async def _hold_bucket_shares(self) -> None:
        """Each consumer within its bucket share (`consumers.shares`): its oldest entries there go first."""
        if not self.bucket_shares:
            return
        known = [k.entry() for k in self.remote.index.values()]
        going = held_within(known, self.bucket_shares, set(self.pending))
        if going:
            removed = await threads.run(self.remote.remove_entries, {e.key for e in going})
            for entry in going:
                METRICS.evicted(entry.named, "bucket")
            log.info("store.evicted", entries=[e.key for e in going], consumers=sorted({str(e.consumer)
                                                                                     for e in going}),
                     bytes=sum(e.bytes for e in going), removed=removed)

    def remove(self, entry: Entry) -> None:
        if self.folder.get(entry.key) is not None:
            self.folder.remove(entry)
        if entry.key in self.remote.index:
            self.refused.add(entry.key)
        self.pending.pop(entry.key, None)

    def set_aside(self, entry: Entry, reason: str) -> str:
        self.refused.add(entry.key)
        self.pending.pop(entry.key, None)
        if self.folder.get(entry.key) is not None:
            return self.folder.set_aside(entry, reason)
        return f"{self.remote.describe()} (no longer offered by this wrapper)"

    def note(self, host: str, slots: dict[int, Entry]) -> bool:
        return self.folder.note(host, slots)

    def sweep(self) -> list[str]:
        return self.folder.sweep()

    def free_bytes(self) -> int:
        return self.folder.free_bytes()

    def used_bytes(self) -> int:
        return self.folder.used_bytes()

    def in_tiers(self) -> tuple[set[str], set[str]]:
        return {e.key for e in self.folder.entries()}, {k for k in self.remote.index if k not in self.refused}

    # -- forget ------------------------------------------------------------------------------------------------

    async def forget_consumer(self, consumer: str) -> dict[str, Any]:
        """Every entry of that consumer goes from the folder and the bucket, and the bucket keeps a tombstone so that
        every other host removes what it holds of it too (at its next look). BucketError when the bucket could not
        be told: the folder's part is done, the caller says the rest must be asked again."""
        at = time.time()
        gone = await threads.run(self.folder.forget, consumer)
        for entry in gone:
            self.pending.pop(entry.key, None)
        async with self._lock():
            await threads.run(self.remote.refresh)
            removed = await threads.run(self.remote.forget, consumer)
            await threads.run(self.remote.tombstone, consumer, at, self.host)
        self.forgotten_at[consumer] = at
        return {"folder": {"entries": len(gone), "bytes": sum(e.bytes for e in gone)},
                "bucket": {"entries": len(removed), "bytes": sum(int(k.record.get("bytes") or 0) for k in removed)}}

    def forgotten(self) -> dict[str, float]:
        return dict(self.forgotten_at)

    async def _follow_tombstones(self) -> None:
        """What other hosts forgot: removed here too (the folder, what is pending, what the bucket still names of
        it from before then: an upload that crossed the forget)."""
        for consumer, at in (await threads.run(self.remote.tombstones)).items():
            if self.forgotten_at.get(consumer, 0.0) >= at:
                continue
            gone = await threads.run(self.folder.forget, consumer, at)
            for entry in gone:
                self.pending.pop(entry.key, None)
            removed = await threads.run(self.remote.forget, consumer, at)
            self.forgotten_at[consumer] = at
            if gone or removed:
                log.info("store.forgotten", consumer=consumer, at=at, folder=len(gone), bucket=len(removed))

    # -- bringing an entry here ------------------------------------------------------------------------------

    async def fetch(self, entry: Entry, going_on: bool = False) -> Entry:
        """Bring the entry into the folder from the bucket (when the folder lacks it); the entry as the folder has
        it. When the bucket no longer holds it because a longer state of its conversation replaced it there (the
        manifests read before that), the longer one instead (`going_on`: that one already)."""
        known = self.remote.index.get(entry.key)
        here = self.folder.get(entry.key)
        if known is None or (here is not None and not self.remote.missing(self.folder.directory, here.record)):
            if here is None:
                raise Unreadable(f"{entry.key} is in neither tier any more")
            return here
        began = time.monotonic()
        deadline = max(FETCH_MIN_S, FETCH_MARGIN * self.fetch_seconds(entry))
        try:
            got = await asyncio.wait_for(threads.run(self.remote.fetch, self.folder.directory, known),
                                         timeout=deadline)
        except NotFound as exc:  # a manifest naming what the bucket lacks: that entry is damaged, not the bucket
            longer = await self._went_on(entry) if not going_on else None
            if longer is not None:  # or another host went on with it since the manifests were read: take that
                log.info("store.went_on", entry=entry.key, tokens=entry.n_tokens, longer=longer.key,
                         longer_tokens=longer.n_tokens)
                return await self.fetch(longer, going_on=True)
            self.refused.add(entry.key)
            raise Unreadable(f"the store lacks part of it: {exc}") from exc
        except TimeoutError as exc:  # a trickling bucket: this turn is prefilled (the fetch goes on meanwhile)
            self.counters.errors += 1
            log.warning("store.fetch_slow", entry=entry.key, deadline_s=round(deadline, 1),
                        store=self.remote.describe())
            raise Unavailable(f"the store did not hand it over within {deadline:.1f}s") from exc
        except (BucketError, OSError) as exc:
            self._failed(exc)
            raise Unavailable(f"the store could not hand it over: {exc}") from exc
        took = time.monotonic() - began
        self._up()
        self.counters.fetches += 1
        self.counters.fetched += got
        objects = max(1, len(known.record.get("chunks", {}).get("names", [])) + 1)
        if took > 0 and got > 1 << 20:
            rate = got / took
            self.counters.fetch_bps = rate if self.counters.fetch_bps is None else 0.7 * self.counters.fetch_bps \
                + 0.3 * rate
        per_object = took / max(1.0, objects / PARALLEL)
        self.counters.object_s = per_object if self.counters.object_s is None else min(self.counters.object_s,
                                                                                        per_object)
        METRICS.store_fetched_bytes.inc(got)
        log.info("store.fetched", entry=entry.key, tokens=entry.n_tokens, bytes=got, objects=objects,
                 ms=round(took * 1000, 1))
        fetched = self.folder.get(entry.key)
        if fetched is None:
            raise Unreadable(f"{entry.key} was fetched but its sidecar cannot be read")
        for other in self.folder.entries():  # as a commit does: what it extends goes from the folder
            with contextlib.suppress(Unreadable):
                if other.key != fetched.key and other.n_tokens < fetched.n_tokens and \
                        fetched.tokens[:other.n_tokens] == other.tokens:
                    self.folder.remove(other)
        return fetched

    def local(self, entry: Entry) -> AbstractAsyncContextManager[Path]:
        return self.folder.local(entry)

    def problem(self, entry: Entry) -> str | None:
        return self.folder.problem(entry) if self.folder.get(entry.key) is not None else None

    async def _went_on(self, entry: Entry) -> Entry | None:
        """The longer state of the entry's conversation the bucket holds now, its manifests read again."""
        try:
            await self.look(force=True)
            tokens = entry.tokens
        except (BucketError, OSError, Unreadable):
            return None
        longer = [k for k in self.remote.index.values() if len(k.tokens) > len(tokens) and
                  k.tokens[:len(tokens)] == tokens and k.key not in self.refused]
        return max(longer, key=lambda k: len(k.tokens)).entry() if longer else None

    def fetch_seconds(self, entry: Entry) -> float:
        here = self.folder.get(entry.key)
        record = here.record if here is not None else entry.record
        if here is not None and entry.key not in self.remote.index:
            return 0.0
        missing = self.remote.missing(self.folder.directory, record)
        if not missing:
            return 0.0
        size = int(record.get("bytes") or 0) * len(missing) / max(1, len(record.get("chunks", {}).get("names", []))
                                                                     + 1)
        rate = self.counters.fetch_bps or ASSUMED_FETCH_BPS
        per_object = self.counters.object_s or ASSUMED_OBJECT_S
        return size / rate + per_object * len(missing) / PARALLEL

    # -- keeping the tiers in step ---------------------------------------------------------------------------

    def _poke(self) -> None:
        """Wake the sync (from any thread: a commit runs on a worker)."""
        if self._wake is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
                self._loop.call_soon_threadsafe(self._wake.set)

    async def background(self) -> None:
        """From ready until the stop: read the manifests every `refresh_s`, upload what is pending, back off
        while the bucket fails."""
        self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                async with self._lock():
                    await self.look()
                    await self.upload_pending()
                failures = 0
                delay = self.refresh_s
            except (BucketError, OSError) as exc:
                self._failed(exc)
                delay = BACKOFF_S[min(failures, len(BACKOFF_S) - 1)]
                failures += 1
            except Exception as exc:  # a bug here must not end the sync for the wrapper's life
                log.exception("store.sync_failed", store=self.remote.describe())
                self._failed(exc)
                delay = BACKOFF_S[-1]
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)

    def _lock(self) -> asyncio.Lock:
        if self._busy is None:
            self._busy = asyncio.Lock()
        return self._busy

    async def first_look(self, within: float) -> None:
        """At a start: read the manifests if the bucket answers within `within` seconds (else the sync will)."""
        try:
            await asyncio.wait_for(self.look(force=True), timeout=within)
        except TimeoutError:
            self._failed(TimeoutError(f"{self.remote.describe()} did not list its manifests within {within:g}s"))
        except (BucketError, OSError) as exc:
            self._failed(exc)

    async def look(self, force: bool = False) -> None:
        """Read the bucket's manifests again when `refresh_s` has passed (or `force`)."""
        now = time.monotonic()
        if not force and self.looked_at is not None and now - self.looked_at < self.refresh_s:
            return
        if not self.key_checked:  # nothing goes up or comes down before the bucket's key is known to be this one
            try:
                await threads.run(self.remote.check_key)
            except WrongKey as exc:
                log.error("store.wrong_key", store=self.remote.describe(), error=str(exc),
                          hint="store.encrypt names another key than the one this bucket folder was sealed with")
                raise BucketError(f"store.encrypt: another key sealed this bucket folder ({exc})") from exc
            self.key_checked = True
        await threads.run(self.remote.refresh)
        await self._follow_tombstones()
        self.looked_at = time.monotonic()
        self._up()
        if not self._reconciled:  # what the folder holds and the bucket does not: committed before a stop
            self._reconciled = True
            if self.remote.sealer is None and await threads.run(self.remote.sealed):
                log.warning("store.sealed_elsewhere", store=self.remote.describe(),
                            hint="this bucket folder's entries are sealed (store.encrypt) and this wrapper has no "
                                 "key: it cannot use them, and what it uploads is not sealed; set store.encrypt")
            for entry in self.folder.entries():
                if entry.key not in self.remote.index and entry.key not in self.pending and entry.by_content \
                        and not self.remote.holds_longer(entry):  # another host went on with it: not sent again
                    self.pending[entry.key] = entry

    async def upload_pending(self, deadline: float | None = None) -> int:
        """Upload the pending entries, oldest first, until none is left (or the deadline); how many went."""
        done = 0
        while self.pending and (deadline is None or time.monotonic() < deadline):
            key, entry = next(iter(self.pending.items()))
            began = time.monotonic()
            if self.remote.holds_longer(entry):  # another host went on with it meanwhile
                del self.pending[key]
                log.info("store.not_uploaded", entry=key, tokens=entry.n_tokens,
                         why="the store holds a longer state of this conversation")
                continue
            try:
                sent = await threads.run(self.remote.upload, self.folder.directory, entry, self.host)
            except Unreadable:
                sent = None  # gone from the folder meanwhile (replaced by a longer state): nothing to upload
            except BucketError as exc:
                if exc.transient:
                    raise
                self.pending.pop(key, None)  # refused for good (too large, forbidden): the others go first
                self.pending[key] = entry
                raise
            if self.pending.get(key) is entry:
                del self.pending[key]
            done += 1
            self._up()
            if sent is None:
                continue
            if sent:
                self.counters.uploads += 1
                self.counters.uploaded += sent
                self.counters.log.append((time.time(), 0, sent))
                METRICS.store_uploaded_bytes.inc(sent)
                log.info("store.uploaded", entry=key, tokens=entry.n_tokens, bytes=sent,
                         ms=round((time.monotonic() - began) * 1000, 1))
            if key in self.remote.index:  # the bucket holds it: its shorter states there are of no more use
                with contextlib.suppress(BucketError):
                    await threads.run(self.remote.forget_shorter, entry)
        if done:
            await self._hold_bucket_shares()
        return done

    async def flush(self, budget_s: float) -> dict[str, Any]:
        """At a drain or a stop: upload what is pending for at most `budget_s`; what went and what did not."""
        began = time.monotonic()
        before = len(self.pending)
        error = None
        try:
            await asyncio.wait_for(self._flush(began + budget_s), timeout=budget_s)
        except TimeoutError:
            error = f"not done within store.flush ({budget_s:g}s)"
        except (BucketError, OSError) as exc:
            self._failed(exc)
            error = str(exc)
        left = len(self.pending)
        report = {"store": self.remote.describe(), "uploaded": before - left, "left": left,
                  "s": round(time.monotonic() - began, 3)}
        if error:
            report["error"] = error
            log.warning("store.flush_incomplete", **report)
        else:
            log.info("store.flushed", **report)
        return report

    async def _flush(self, deadline: float) -> None:
        async with self._lock():  # after the sync's round in flight, never beside it
            if not self._reconciled:
                await self.look(force=True)
            await self.upload_pending(deadline)

    def _failed(self, exc: Exception) -> None:
        self.counters.errors += 1
        METRICS.store_errors.inc()
        text = str(exc)
        if self.state != "down":
            log.warning("store.down", store=self.remote.describe(), error=text,
                        pending=len(self.pending), hint="serving from the folder; retrying with a backoff")
        self.state, self.error = "down", text

    def _up(self) -> None:
        if self.state == "down":
            log.info("store.up", store=self.remote.describe(), pending=len(self.pending))
        self.state, self.error = "up", None

    # -- what it reports -------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        here = self.folder.entries()
        index = list(self.remote.index.values())
        counters = self.counters
        return {
            "local": {"dir": str(self.folder.directory), "entries": len(here), "bytes": self.folder.used_bytes(),
                      "written_last_hour": counters.last_hour(1)},
            "store": {"url": self.remote.describe(), "endpoint": self.remote.bucket.endpoint, "state": self.state,
                      "sealed": self.remote.sealer is not None,
                      "error": self.error, "entries": len(index),
                      "bytes": sum(int(k.record.get("bytes") or 0) for k in index),
                      "pending": len(self.pending), "uploads": counters.uploads, "uploaded_bytes": counters.uploaded,
                      "uploaded_last_hour": counters.last_hour(2), "fetches": counters.fetches,
                      "fetched_bytes": counters.fetched, "fetch_bytes_per_s": counters.fetch_bps,
                      "errors": counters.errors,
                      "looked_s_ago": round(time.monotonic() - self.looked_at, 1) if self.looked_at else None},
        }

    def metrics(self) -> None:
        here = self.folder.entries()
        index = list(self.remote.index.values())
        METRICS.store_entries.labels(tier="local").set(len(here))
        METRICS.store_entries.labels(tier="store").set(len(index))
        METRICS.store_bytes.labels(tier="local").set(self.folder.used_bytes())
        METRICS.store_bytes.labels(tier="store").set(sum(int(k.record.get("bytes") or 0) for k in index))
        METRICS.store_pending.set(len(self.pending))
        METRICS.store_fetch_rate.set(self.counters.fetch_bps or 0)
        METRICS.store_up.set(1 if self.state == "up" else 0)
