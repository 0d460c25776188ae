"""A sealed bucket sealed again under a new key (`llama-wrapper slots rekey`): the folder's check object becomes
the new key's first, so that a wrapper started with the old key is refused from then on; then every entry the old
key opens is fetched, opened, committed under the new key's names and uploaded sealed with it, and only then are
its old objects deleted. Entry by entry, the new copy whole before the old goes: safe to interrupt, and a second
run goes on where the first stopped (what the new key opens is left as it is; an entry both keys open was never
sealed, and stays so)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hooks.store.bucket import Bucket, NotFound
from hooks.store.folder import DirectoryStore
from hooks.store.interface import Unreadable
from hooks.store.remote import Known, Remote
from hooks.store.sealing import CHECK_NAME, Sealer, WrongKey

_DERIVED = ("key", "tokens", "file", "bytes", "fingerprint", "tail_bytes", "chunks", "host", "keyed_names")
# what a commit and an upload write anew


@dataclass
class Rekeyed:
    """What a run did to one model folder of the bucket."""

    folder: str
    entries: int = 0  # sealed again by this run
    bytes: int = 0  # of what it uploaded
    done_before: int = 0  # the new key's already (an earlier run's, or a host's since the check changed)
    unreadable: int = 0  # manifests neither key opens, and entries the old key opens that are not whole or not what
    # their manifest says (a host's folder from before an earlier rekey uploaded again): left as they are

    def as_dict(self) -> dict[str, object]:
        return {"folder": self.folder, "entries": self.entries, "bytes": self.bytes, "done_before": self.done_before,
                "unreadable": self.unreadable}


def sealed_folders(bucket: Bucket) -> list[str]:
    """The model folders of the bucket's prefix that hold a check object (those a sealing wrapper wrote to)."""
    found = []
    for name in bucket.folders():
        try:
            bucket.get(f"{name}/{CHECK_NAME}")
        except NotFound:
            continue
        found.append(name)
    return found


def rekey(bucket: Bucket, folder: str, old: Sealer, new: Sealer, chunk_tokens: int,
          told: Callable[[int, int], None] = lambda done, total: None,
          skipped: Callable[[str, str], None] = lambda key, why: None) -> Rekeyed:
    """Seal one model folder again under `new`; WrongKey when its check object is neither key's. `told(done,
    total)`: progress, after each entry; `skipped(key, why)`: an entry left as it is."""
    old_remote, new_remote = Remote(bucket, folder, old), Remote(bucket, folder, new)
    check = bucket.get(old_remote.folder + CHECK_NAME)
    try:
        new.verify(check)  # an earlier run changed it already
    except WrongKey:
        old.verify(check)  # WrongKey: neither key sealed this folder
        bucket.put(old_remote.folder + CHECK_NAME, new.check())
    listed, _ = old_remote.refresh()
    new_remote.refresh()
    done = Rekeyed(folder, unreadable=listed - len(old_remote.index.keys() | new_remote.index.keys()))
    moving = [k for k in old_remote.index.values() if k.key not in new_remote.index]
    done.done_before = len(new_remote.index.keys() - old_remote.index.keys())
    for n, known in enumerate(moving, start=1):
        try:
            done.bytes += _move(old_remote, new_remote, known, old, new, chunk_tokens)
            done.entries += 1
        except Unreadable as exc:  # this entry's fault, not the bucket's: the others go on
            done.unreadable += 1
            skipped(known.key, str(exc))
        told(n, len(moving))
    return done


def _move(old_remote: Remote, new_remote: Remote, known: Known, old: Sealer, new: Sealer, chunk_tokens: int) -> int:
    """One entry: fetched and opened, committed under the new key's names, uploaded sealed with it; then its old
    objects deleted. The bytes uploaded."""
    work = Path(tempfile.mkdtemp(prefix="llama-wrapper-rekey-"))
    try:
        was = DirectoryStore(work / "old", chunk_tokens=chunk_tokens, names=old.names)
        was.directory.mkdir(parents=True)
        old_remote.fetch(was.directory, known)
        entry = was.get(known.key)
        if entry is None or entry.problem is not None:
            raise Unreadable(f"conv-{known.key}: fetched, but not readable here")
        record = {k: v for k, v in known.record.items() if k not in _DERIVED}
        now = DirectoryStore(work / "new", chunk_tokens=chunk_tokens, names=new.names)
        now.directory.mkdir(parents=True)
        with now.part("rekey") as part:
            was.write_state(entry, part)
            moved = now.commit(part, known.tokens, record)
        host = known.record.get("host")
        sent = new_remote.upload(now.directory, moved, host if isinstance(host, str) else "rekey")
        if sent is None:
            raise Unreadable(f"conv-{known.key}: its new copy went from the work folder before its upload")
        old_remote.remove_entries({known.key})
        return sent
    finally:
        shutil.rmtree(work, ignore_errors=True)

