"""A model's slot folder in an object store (`store.url`): the same names under `<prefix><model folder>/` —
manifests `conv-<key>.json`, tails `conv-<key>-<fingerprint>.bin`, chunks `chunks/<name>.kv` — so that an entry
is uploaded and fetched file by file and the local folder (hooks/store/folder.py) reads what was fetched as its own.

An upload writes the chunks and the tail first, each only if absent (`If-None-Match: *`: a 412 means another host
wrote it, which is as good), the manifest last: a manifest never names an object that is not whole. The manifest
is written with a condition too — absent, or the version this host last saw — so two hosts committing one
conversation never overwrite each other: the loser keeps the winner's, which holds the same tokens. A remote
manifest carries its tokens (the local one finds them in its tail), so that a lookup needs no other object.

Every call is blocking (hooks/store/bucket.py); the tiered store runs them in threads.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hooks.store import layout
from hooks.store.bucket import Bucket, Conflict, NotFound
from hooks.store.chunk_folder import ChunkFolder, names_of, plan_problem, size_of
from hooks.store.interface import Entry, Unreadable, owner_of
from hooks.store.sealing import CHECK_NAME, MAGIC, NONCE, Sealer
from hooks.store.threads import map_on
from wrapper.configuration.consumers import name_of

_MANIFEST = re.compile(r"^conv-([0-9a-f]{16})\.json$")
_TAIL = re.compile(r"^conv-[0-9a-f]{16}-[0-9a-f]{12}\.bin$")
PARALLEL = 8  # objects moved at once
SEALING = len(MAGIC) + NONCE + 16  # what sealing adds to an object: the mark, the nonce, the tag
TOMBSTONE = "forgotten-"  # `forgotten-<consumer>.json`: when a consumer's conversations were forgotten


@dataclass
class Known:
    """A manifest the bucket holds, as of the last look."""

    key: str
    etag: str
    record: dict[str, Any]
    tokens: list[int]
    modified: float

    def entry(self) -> Entry:
        tokens = self.tokens
        return Entry(self.key, len(tokens), int(self.record.get("bytes") or 0), self.modified, self.record,
                     str(self.record.get("file")), True, lambda: tokens, tokens)


class Remote:
    def __init__(self, bucket: Bucket, folder: str, sealer: Sealer | None = None) -> None:
        self.bucket = bucket
        self.sealer = sealer  # store.encrypt: what goes up is sealed, what comes down opened
        self.folder = folder.strip("/") + "/"  # the model's folder name under the prefix
        self.index: dict[str, Known] = {}
        self.chunks: set[str] = set()  # chunks this wrapper put, or saw whole there: not sent again
        self.named: set[str] = set()  # chunks other hosts' manifests name: checked (HEAD) before being trusted

    def describe(self) -> str:
        return f"{self.bucket.url}{self.folder} at {self.bucket.endpoint}"

    # -- the index ----------------------------------------------------------------------------------------------

    def refresh(self) -> tuple[int, int]:
        """List the manifests and read those that are new or changed: (manifests, read now)."""
        listed = {m.group(1): o for o in self.bucket.list(self.folder + "conv-")
                  if (m := _MANIFEST.match(o.name[len(self.folder):]))}
        index = {key: known for key, known in self.index.items() if key in listed}  # a new one, swapped in whole:
        changed = [o for key, o in listed.items() if key not in index or index[key].etag != o.etag]  # lookups
        for known in map_on(PARALLEL, self._read, changed):  # read the old one meanwhile, on another thread
            if known is not None:
                index[known.key] = known
                self.named.update(names_of(known.record))
        self.index = index
        return len(listed), len(changed)

    def _read(self, listed: Any) -> Known | None:
        try:
            data = json.loads(self.bucket.get(listed.name))
            key = _MANIFEST.match(listed.name[len(self.folder):])
            tokens = np.frombuffer(self._tokens_of(data, listed.name[len(self.folder):]), dtype="<i4").tolist()
            if key is None or data.get("key") != key.group(1) or len(tokens) != data.get("tokens") or \
                    not _TAIL.match(str(data.get("file"))) or plan_problem(data) is not None or \
                    int(data.get("bytes")) < 0 or not isinstance(data.get("model"), dict):
                return None
        except NotFound:
            return None
        except (ValueError, KeyError, TypeError, AttributeError, Unreadable):
            return None  # not a manifest of ours (or damaged, or sealed with another key): never offered
        return Known(key.group(1), listed.etag, data, tokens, listed.modified)

    def _tokens_of(self, manifest: dict[str, Any], name: str) -> bytes:
        """A manifest's token ids (its `sealed_token_ids` opened with the consumer's key; Unreadable without it)."""
        if "sealed_token_ids" in manifest:
            sealed = base64.b64decode(manifest.pop("sealed_token_ids"))
            if self.sealer is None:
                raise Unreadable(f"{name} is sealed (store.encrypt) and this wrapper has no key")
            return self.sealer.open(sealed, owner_of(manifest), name)
        return base64.b64decode(manifest.pop("token_ids"))

    # -- upload -------------------------------------------------------------------------------------------------

    def upload(self, directory: Path, entry: Entry, host: str) -> int | None:
        """Put the entry's chunks, tail and manifest; the bytes sent (0 when the bucket held it already), None when
        the folder no longer holds it."""
        sidecar = layout.entry_sidecar(directory, entry.key)
        try:
            record = layout.read_sidecar(sidecar)
        except layout.SidecarError:
            return None  # gone meanwhile (replaced by a longer state, evicted): nothing to upload
        known = self.index.get(entry.key)
        if known is not None and known.record.get("file") == record.get("file"):
            return 0
        folder = ChunkFolder(directory)
        size = size_of(record)
        missing = [n for n in names_of(record) if n not in self.chunks]
        owner = owner_of(record)
        sent = sum(map_on(PARALLEL, lambda n: self._put_chunk(n, folder.path(n), size, owner), missing))
        self.chunks.update(missing)
        sent += self._put_file(str(record["file"]), directory / str(record["file"]), owner)
        words = np.asarray(entry.tokens, dtype="<i4").tobytes()
        manifest = {**record, "host": host, **(
            {"token_ids": base64.b64encode(words).decode()} if self.sealer is None else
            {"sealed_token_ids": base64.b64encode(self.sealer.seal(words, owner, sidecar.name)).decode()})}
        body = json.dumps(manifest).encode()
        try:
            etag = self.bucket.put(self.folder + sidecar.name, body, if_none_match=known is None,
                                   if_match=known.etag if known is not None else None)
        except Conflict:
            return sent  # another host committed this conversation meanwhile: theirs stays (the next look reads it)
        self.index[entry.key] = Known(entry.key, etag, record, list(entry.tokens), entry.last_used)
        return sent + len(body)

    def _put_chunk(self, name: str, path: Path, size: int, owner: str | None) -> int:
        """A chunk another manifest names is only skipped once the bucket is seen to hold it whole."""
        if name in self.named:
            there = self.bucket.head(f"{self.folder}chunks/{name}.kv")
            if there is not None and there.size == size + (SEALING if self.sealer is not None else 0):
                return 0
            if there is not None:  # cut short: ours replaces it
                return self._put_file(f"chunks/{name}.kv", path, owner, only_new=False)
        return self._put_file(f"chunks/{name}.kv", path, owner)

    def _put_file(self, name: str, path: Path, owner: str | None, only_new: bool = True) -> int:
        try:
            size = path.stat().st_size
            if self.sealer is not None:  # sealed whole: a chunk or a tail, never a whole state
                sealed = self.sealer.seal(path.read_bytes(), owner, name)
                self.bucket.put(self.folder + name, sealed, if_none_match=only_new)
                return len(sealed)
            with path.open("rb") as data:  # streamed: never a whole state in memory
                self.bucket.put(self.folder + name, data, if_none_match=only_new)
        except FileNotFoundError as exc:
            raise Unreadable(f"{path.name} is gone") from exc
        except Conflict:
            return 0  # there already: a chunk or tail is named by what it holds
        return size

    def holds_longer(self, entry: Entry) -> bool:
        """Whether the bucket holds a longer state of the entry's conversation (all its tokens first): the entry
        is of no use there."""
        try:
            tokens = entry.tokens
        except Unreadable:
            return False
        return any(len(known.tokens) > len(tokens) and known.tokens[:len(tokens)] == tokens
                   for known in self.index.values())

    def forget_shorter(self, entry: Entry) -> int:
        """Remove the manifests (and tails) of shorter states of the entry's conversation, as a commit does in a
        folder: the longer one holds all they hold and names their chunks; how many went."""
        gone = 0
        for known in list(self.index.values()):
            if known.key != entry.key and len(known.tokens) < entry.n_tokens \
                    and entry.tokens[:len(known.tokens)] == known.tokens:
                self.bucket.delete(f"{self.folder}conv-{known.key}.json")
                self.bucket.delete(self.folder + str(known.record.get("file")))
                self.index.pop(known.key, None)
                gone += 1
        return gone

    # -- the key ------------------------------------------------------------------------------------------------

    def check_key(self) -> bool:
        """store.encrypt: the folder's check object opened with this key (WrongKey when another sealed it), or left
        there by this one; whether it was there already."""
        assert self.sealer is not None
        try:
            self.sealer.verify(self.bucket.get(self.folder + CHECK_NAME))
            return True
        except NotFound:
            try:
                self.bucket.put(self.folder + CHECK_NAME, self.sealer.check(), if_none_match=True)
            except Conflict:  # another host left one meanwhile: it must be this key's too
                self.sealer.verify(self.bucket.get(self.folder + CHECK_NAME))
            return False

    def sealed(self) -> bool:
        """Whether a key left its check object here (store.encrypt)."""
        return self.bucket.head(self.folder + CHECK_NAME) is not None

    # -- forget ---------------------------------------------------------------------------------------------------

    def forget(self, consumer: str, before: float | None = None) -> list[Known]:
        """Delete every manifest of that consumer (of every `cache_salt`; saved before `before`, when given) with its
        tail, and the chunks no other manifest names; what went."""
        gone = [k for k in self.index.values() if isinstance(owner := k.record.get("consumer"), str)
                and name_of(owner) == consumer and (
            before is None or float(k.record.get("saved_at") or 0.0) <= before)]
        self._delete(gone)
        return gone

    def remove_entries(self, keys: set[str]) -> int:
        """Delete those entries (their manifests, tails, and the chunks no other manifest names); how many went."""
        gone = [k for k in self.index.values() if k.key in keys]
        self._delete(gone)
        return len(gone)

    def _delete(self, gone: list[Known]) -> None:
        names = {n for k in gone for n in names_of(k.record)}
        for known in gone:  # the manifest first: nothing names a half-removed entry
            self.bucket.delete(f"{self.folder}conv-{known.key}.json")
            self.bucket.delete(self.folder + str(known.record.get("file")))
            self.index.pop(known.key, None)
        unnamed = names - {n for k in self.index.values() for n in names_of(k.record)}
        map_on(PARALLEL, lambda n: self.bucket.delete(f"{self.folder}chunks/{n}.kv"), sorted(unnamed))
        self.chunks -= unnamed

    def tombstone(self, consumer: str, at: float, host: str) -> None:
        """Tell the other hosts on the bucket: what that consumer kept until `at` is forgotten."""
        body = json.dumps({"consumer": consumer, "at": at, "host": host}).encode()
        self.bucket.put(f"{self.folder}{TOMBSTONE}{consumer}.json", body)

    def tombstones(self) -> dict[str, float]:
        """consumer -> when what it kept was last forgotten, as the bucket says."""
        found: dict[str, float] = {}
        for listed in self.bucket.list(self.folder + TOMBSTONE):
            try:
                data = json.loads(self.bucket.get(listed.name))
                found[str(data["consumer"])] = float(data["at"])
            except NotFound:
                continue
            except (ValueError, KeyError, TypeError):
                continue  # not ours: never acted on
        return found

    # -- fetch --------------------------------------------------------------------------------------------------

    def missing(self, directory: Path, record: dict[str, Any]) -> list[str]:
        """The entry's objects the local folder lacks (by their names in the bucket)."""
        folder = ChunkFolder(directory)
        size = size_of(record)
        names = [f"chunks/{n}.kv" for n in names_of(record) if not folder.has(n, size)]
        tail = directory / str(record.get("file"))
        if not tail.exists():
            names.append(str(record.get("file")))
        return names

    def fetch(self, directory: Path, known: Known) -> int:
        """Bring the entry's objects into the local folder and commit its sidecar there; the bytes fetched."""
        record = known.record
        wanted = self.missing(directory, record)
        (directory / "chunks").mkdir(parents=True, exist_ok=True)
        got = sum(map_on(PARALLEL, lambda name: self._get_file(directory, name, owner_of(record)), wanted))
        layout.write_sidecar(layout.entry_sidecar(directory, known.key), record)
        return got

    def _get_file(self, directory: Path, name: str, owner: str | None) -> int:
        target = directory / name
        temporary = target.with_name(f"{target.name}.{layout.temporary_tag()}.tmp")  # swept if it dies
        try:
            if self.sealer is not None:  # opened whole (sealed or not: one written without the key is read as it is)
                data = self.bucket.get(self.folder + name)
                temporary.write_bytes(self.sealer.open(data, owner, name))
                size = len(data)
            else:
                size = self.bucket.get_to(self.folder + name, temporary)
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(OSError):
                temporary.unlink()
        return size
