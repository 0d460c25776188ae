"""What the bucket holds of consumers, against a real S3 server (SeaweedFS): sealed with `store.encrypt` (a host
with the key fetches it whole, one without finds nothing it can use, another key is refused, what was written
before the key stays readable), and forgotten on every host (`forget_consumer`, the tombstone)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from hooks.store.bucket import Bucket
from hooks.store.chunk_folder import names_of
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.rekey import rekey, sealed_folders
from hooks.store.remote import Remote
from hooks.store.sealing import Sealer, WrongKey, read_secret
from hooks.store.tiered import TieredStore
from tests.s3server import S3Server
from tests.slotfiles import kv_state as state
from wrapper.cli.main import main

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


NEW_KEY = b"the-new-key-of-more-than-sixteen-characters"


async def test_a_bucket_sealed_again_under_a_new_key_opens_with_it_alone_and_a_run_cut_short_goes_on(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    """`slots rekey`: three entries (two consumers' private ones, one nobody's) sealed with the old key; a run is
    cut after its first entry — the old key is refused already, nothing is lost (each entry opens with one key or
    the other); a second run moves the other two. Then the new key fetches each whole, the old one finds nothing,
    and nothing the old key sealed is left in the bucket."""
    a = host(server, tmp_path / "a", prefix, "a", KEY)
    a.remote.check_key()
    conversations = {n: [70_000 + 1000 * n + i for i in range(50)] for n in range(3)}
    data = {n: save(a, tokens, **({"consumer": who, "private": True} if who else {}))
            for (n, tokens), who in zip(conversations.items(), ("alice", "bob", None), strict=True)}
    await a.look(force=True)
    await a.upload_pending()
    before = set(objects(server, prefix))
    bucket = a.remote.bucket
    assert sealed_folders(bucket) == ["model"]

    class CutShort(Exception):
        pass

    def cut(done: int, total: int) -> None:
        assert total == 3
        raise CutShort

    with pytest.raises(CutShort):
        await asyncio.to_thread(rekey, bucket, "model", Sealer(KEY), Sealer(NEW_KEY), 16, cut)
    with pytest.raises(WrongKey):  # refused from the first step on
        host(server, tmp_path / "late", prefix, "late", KEY).remote.check_key()
    by_key = [Remote(bucket, "model", Sealer(key)) for key in (KEY, NEW_KEY)]
    for each in by_key:
        each.refresh()
    assert (len(by_key[0].index), len(by_key[1].index)) == (2, 1)  # each entry opens with one key or the other

    done = await asyncio.to_thread(rekey, bucket, "model", Sealer(KEY), Sealer(NEW_KEY), 16)
    assert (done.entries, done.done_before, done.unreadable) == (2, 1, 0), done
    again = await asyncio.to_thread(rekey, bucket, "model", Sealer(KEY), Sealer(NEW_KEY), 16)
    assert (again.entries, again.done_before) == (0, 3), again  # a third run finds nothing left

    b = host(server, tmp_path / "b", prefix, "b", NEW_KEY)
    assert b.remote.check_key()
    await b.look(force=True)
    for n, tokens in conversations.items():
        entry, shared = b.best(tokens)
        assert entry is not None and shared == len(tokens)
        async with b.local(await b.fetch(entry)) as path:
            assert path.read_bytes() == data[n]
    old = Remote(bucket, "model", Sealer(KEY))
    old.refresh()
    assert not old.index  # the old key opens no manifest
    assert not (before - {f"{prefix}/model/sealed.json"}) & set(objects(server, prefix))  # none of its objects


async def test_the_rekey_command_says_what_it_did_and_what_to_do(tmp_path: Path, server: S3Server,
                                                                 prefix: str) -> None:
    """`llama-wrapper slots rekey --config C --new-key K`: its progress, a line per model folder, what to do next;
    refusals that say why: the same key, a key that did not seal the bucket, no sealed bucket in the config."""
    a = host(server, tmp_path / "a", prefix, "a", KEY)
    a.remote.check_key()
    save(a, TOKENS[:50], consumer="alice", private=True)
    await a.look(force=True)
    await a.upload_pending()
    old_file, new_file, other_file = (tmp_path / name for name in ("old.key", "new.key", "other.key"))
    for file, key in ((old_file, KEY), (new_file, NEW_KEY), (other_file, OTHER_KEY)):
        file.write_bytes(key + b"\n")
    config = tmp_path / "team.yaml"
    config.write_text(f"store: {{url: {server.store(prefix)}, encrypt: {old_file}}}\n")
    runner = CliRunner()

    def rekey_with(key_file: Path, config_file: Path = config) -> Result:
        return invoked(runner, ["slots", "rekey", "--config", str(config_file), "--new-key", str(key_file)],
                            server)

    same = await asyncio.to_thread(rekey_with, old_file)
    assert same.exit_code == 1 and "holds the key the bucket is sealed with now" in same.output
    done = await asyncio.to_thread(rekey_with, new_file)
    assert done.exit_code == 0, done.output
    assert "model: 1 of 1 entries sealed again" in done.output and "Set store.encrypt to" in done.output
    assert '"entries": 1' in done.output
    wrong = await asyncio.to_thread(rekey_with, other_file)  # the config still names the old key
    assert wrong.exit_code == 1 and "neither key sealed" in wrong.output, wrong.output
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"store: {{url: {server.store(prefix)}}}\n")
    none = await asyncio.to_thread(rekey_with, new_file, plain)
    assert none.exit_code == 1 and "no store.url with store.encrypt" in none.output


def invoked(runner: CliRunner, argv: list[str], server: S3Server) -> Result:
    """The command line as a user runs it, reaching the S3 server as the wrapper does (the environment)."""
    return runner.invoke(main, argv, env=server.env())


async def test_a_rekey_leaves_an_entry_it_cannot_open_whole_and_moves_the_others(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    """One entry's chunk was sealed with another key (a host's folder from before an earlier rekey, uploaded
    again): that entry is counted as unreadable and left as it is, said by name; the others are sealed again."""
    a = host(server, tmp_path / "a", prefix, "a", KEY)
    a.remote.check_key()
    conversations = {n: [80_000 + 1000 * n + i for i in range(50)] for n in range(2)}
    for tokens in conversations.values():
        save(a, tokens, consumer="alice", private=True)
    await a.look(force=True)
    await a.upload_pending()
    bucket, bad = a.remote.bucket, next(iter(a.remote.index.values()))
    chunk = f"chunks/{names_of(bad.record)[0]}.kv"
    stored = objects(server, prefix)[f"{prefix}/model/{chunk}"]
    bucket.put(f"model/{chunk}", Sealer(OTHER_KEY).seal(stored, "alice", chunk))
    said: list[tuple[str, str]] = []
    done = await asyncio.to_thread(rekey, bucket, "model", Sealer(KEY), Sealer(NEW_KEY), 16,
                                   lambda n, total: None, lambda key, why: said.append((key, why)))
    assert (done.entries, done.unreadable) == (1, 1), done
    assert [key for key, _ in said] == [bad.key] and "another key" in said[0][1], said


def test_a_folder_named_with_another_key_is_not_offered_nor_sent_to_the_bucket(tmp_path: Path) -> None:
    """After a rekey, a host's folder from before it (its entries' names hashed with the old key): a store with the
    new key neither offers them nor counts them (so never uploads them); one that reads the folder without a key
    (`slots ls`) still lists them."""
    old = DirectoryStore(tmp_path / "model", chunk_tokens=16, names=Sealer(KEY).names)
    save_into_folder(old, TOKENS[:40])
    assert len(old.entries()) == 1 and old.entries()[0].record["keyed_names"] != Sealer(NEW_KEY).names
    new = DirectoryStore(tmp_path / "model", chunk_tokens=16, names=Sealer(NEW_KEY).names)
    assert new.entries() == [] and new.best(TOKENS[:40]) == (None, 0)
    assert len(DirectoryStore(tmp_path / "model").entries()) == 1
    same = DirectoryStore(tmp_path / "model", chunk_tokens=16, names=Sealer(KEY).names)
    assert same.best(TOKENS[:40])[1] == 40


def save_into_folder(store: DirectoryStore, tokens: list[int]) -> None:
    store.directory.mkdir(parents=True, exist_ok=True)
    part = store.directory / part_name("test")
    part.write_bytes(state(tokens))
    store.commit(part, tokens, {**RECORD, "consumer": "alice", "private": True})
