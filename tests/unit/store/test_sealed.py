"""What the bucket holds of consumers, against a real S3 server (SeaweedFS): sealed with `store.encrypt` (a host
with the key fetches it whole, one without finds nothing it can use, another key is refused, what was written
before the key stays readable), and forgotten on every host (`forget_consumer`, the tombstone)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hooks.store.bucket import Bucket
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.remote import Remote
from hooks.store.sealing import Sealer, WrongKey, read_secret
from hooks.store.tiered import TieredStore
from tests.s3server import S3Server
from tests.slotfiles import kv_state as state

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16"}
TOKENS = list(range(70_000, 70_090))
KEY, OTHER_KEY = b"a-key-of-more-than-sixteen-characters", b"another-key-of-more-than-sixteen"


def host(server: S3Server, folder: Path, prefix: str, name: str, key: bytes | None = None) -> TieredStore:
    bucket = Bucket(server.store(prefix), endpoint=server.endpoint, access_key=server.access_key,
                    secret_key=server.secret_key, region="us-east-1", timeout_s=3)
    sealer = Sealer(key) if key is not None else None
    folder_store = DirectoryStore(folder / "model", chunk_tokens=16, names=sealer.names if sealer else None)
    return TieredStore(folder_store, Remote(bucket, "model", sealer), name, 0.0)


def save(store: TieredStore, tokens: list[int], **record: object) -> bytes:
    data = state(tokens)
    store.folder.directory.mkdir(parents=True, exist_ok=True)
    part = store.folder.directory / part_name("test")
    part.write_bytes(data)
    store.commit(part, tokens, {**RECORD, **record})
    return data


def objects(server: S3Server, prefix: str) -> dict[str, bytes]:
    client = server._client()
    listed = client.list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/").get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=server.bucket, Key=o["Key"])["Body"].read() for o in listed}


async def test_a_sealed_bucket_yields_nothing_without_the_key(tmp_path: Path, server: S3Server, prefix: str) -> None:
    a = host(server, tmp_path / "a", prefix, "a", KEY)
    a.remote.check_key()
    data = save(a, TOKENS[:70], consumer="alice", private=True)
    await a.look(force=True)
    await a.upload_pending()
    stored = objects(server, prefix)
    words = np.asarray(TOKENS[:70], dtype="<i4").tobytes()
    assert len(stored) >= 4 and not any(words[:64] in body for body in stored.values())  # no tokens in clear
    assert not any(data[-4096:] in body for body in stored.values())  # nor the KV
    assert all(b"\"token_ids\"" not in body for body in stored.values())
    # the same key: fetched whole; no key: nothing to use; another key: refused
    b = host(server, tmp_path / "b", prefix, "b", KEY)
    await b.look(force=True)
    entry, shared = b.best(TOKENS[:70])
    assert entry is not None and shared == 70
    fetched = await b.fetch(entry)
    async with b.local(fetched) as path:
        assert path.read_bytes() == data
    c = host(server, tmp_path / "c", prefix, "c")
    await c.look(force=True)
    assert c.best(TOKENS[:70]) == (None, 0) and not c.remote.index
    d = host(server, tmp_path / "d", prefix, "d", OTHER_KEY)
    with pytest.raises(WrongKey):
        d.remote.check_key()


async def test_entries_written_before_the_key_stay_readable(tmp_path: Path, server: S3Server, prefix: str) -> None:
    plain = host(server, tmp_path / "p", prefix, "p")
    data = save(plain, TOKENS[:40])
    await plain.look(force=True)
    await plain.upload_pending()
    sealed = host(server, tmp_path / "s", prefix, "s", KEY)
    sealed.remote.check_key()
    await sealed.look(force=True)
    entry, shared = sealed.best(TOKENS[:40])
    assert entry is not None and shared == 40
    async with sealed.local(await sealed.fetch(entry)) as path:
        assert path.read_bytes() == data


def test_a_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist; make one with"):
        read_secret(tmp_path / "none")
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="fewer than 16 characters"):
        read_secret(tmp_path / "short")
    (tmp_path / "key").write_text("  " + KEY.decode() + "\nignored\n")
    assert read_secret(tmp_path / "key") == KEY
    alice, bob = Sealer(KEY).seal(b"x", "alice", "n"), Sealer(KEY)
    with pytest.raises(Exception, match="sealed with another key"):
        bob.open(alice, "bob", "n")  # one consumer's key opens no other's
    with pytest.raises(Exception, match="sealed with another key"):
        bob.open(alice, "alice", "another-name")  # nor under another object's name
    assert bob.open(alice, "alice", "n") == b"x"


async def test_a_forgotten_consumer_is_gone_from_every_host(tmp_path: Path, server: S3Server, prefix: str) -> None:
    a, b = host(server, tmp_path / "a", prefix, "a"), host(server, tmp_path / "b", prefix, "b")
    save(a, TOKENS[:70], consumer="alice", private=True)
    save(a, TOKENS[:50] + [5] * 20, consumer="bob", private=True)
    await a.look(force=True)
    await a.upload_pending()
    await b.look(force=True)
    entry, _ = b.best(TOKENS[:70])
    assert entry is not None and entry.consumer == "alice"
    await b.fetch(entry)  # b's folder holds alice's too
    answer = await a.forget_consumer("alice")
    assert answer["folder"]["entries"] == 1 and answer["bucket"]["entries"] == 1
    left = objects(server, prefix)
    assert [k for k in left if k.endswith(".json") and "conv-" in k] and all(
        b'"alice"' not in body for k, body in left.items() if "conv-" in k)
    assert any("forgotten-alice.json" in k for k in left)
    await b.look(force=True)  # the tombstone: b forgets what it holds of alice's from before then
    assert [e.consumer for e in b.folder.entries()] == [] and b.forgotten()["alice"] > 0
    assert [e.consumer for e in a.entries()] == ["bob"]
