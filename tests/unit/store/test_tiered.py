"""The folder in front of a bucket (hooks/store/tiered.py) against a real S3 server (SeaweedFS): an entry committed on
one host is found and fetched whole by another, two hosts committing one conversation never clobber each other,
each turn uploads only what it adds, damaged or missing objects are refused without failing anything, the bucket
going away and coming back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hooks.store.bucket import Bucket
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.interface import Unreadable
from hooks.store.remote import Remote
from hooks.store.tiered import TieredStore
from tests.s3server import S3Server
from tests.slotfiles import kv_state as state
from wrapper.cli.main import main

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16"}


def host(server: S3Server, folder: Path, prefix: str, name: str = "h") -> TieredStore:
    bucket = Bucket(server.store(prefix), endpoint=server.endpoint, access_key=server.access_key,
                    secret_key=server.secret_key, region="us-east-1", timeout_s=3)
    return TieredStore(DirectoryStore(folder / "model", chunk_tokens=16), Remote(bucket, "model"), name, 0.0)


def store_config(tmp_path: Path, server: S3Server, prefix: str, slots_dir: Path) -> Path:
    """A config naming `slots_dir` and the test server's bucket, with its endpoint and credentials."""
    config = tmp_path / "c.yaml"
    config.write_text(f"slots: {{dir: {slots_dir}}}\nstore: {{url: {server.store(prefix)}, endpoint: "
                      f"'{server.endpoint}', access_key: {server.access_key}, secret_key: {server.secret_key}, "
                      "region: us-east-1, timeout: 3s}\n")
    return config


def save(store: TieredStore, tokens: list[int]) -> bytes:
    data = state(tokens)
    store.folder.directory.mkdir(parents=True, exist_ok=True)
    part = store.folder.directory / part_name("test")
    part.write_bytes(data)
    store.commit(part, tokens, RECORD)
    return data


async def restored(store: TieredStore, tokens: list[int]) -> bytes:
    entry, shared = store.best(tokens)
    assert entry is not None and shared == len(tokens)
    entry = await store.fetch(entry)
    async with store.local(entry) as path:
        return path.read_bytes()


TOKENS = list(range(1000, 1090))


async def test_a_conversation_committed_on_one_host_is_fetched_whole_by_another(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a, b = host(server, tmp_path / "a", prefix, "a"), host(server, tmp_path / "b", prefix, "b")
    data = save(a, TOKENS[:70])
    await a.upload_pending()
    assert a.pending == {} and a.counters.uploaded > len(data)
    await b.look(force=True)
    assert b.where(b.entries()[0]) == "store" and b.fetch_seconds(b.entries()[0]) > 0
    assert await restored(b, TOKENS[:70]) == data
    assert b.where(b.entries()[0]) == "both" and b.fetch_seconds(b.entries()[0]) == 0  # in b's folder now
    assert b.counters.fetched >= len(data) - 2000
    # the next turn, on b: only what it adds goes up
    longer = save(b, TOKENS)
    await b.upload_pending()
    assert b.counters.uploaded < len(longer) / 2
    await a.look(force=True)
    assert await restored(a, TOKENS) == longer
    assert [e.n_tokens for e in a.entries() if a.where(e) != "gone"] == [90]  # a's shorter one is gone too


async def test_two_hosts_committing_one_conversation_never_clobber_each_other(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a, b = host(server, tmp_path / "a", prefix, "a"), host(server, tmp_path / "b", prefix, "b")
    save(a, TOKENS)
    save(b, TOKENS)
    await asyncio.gather(a.upload_pending(), b.upload_pending())
    c = host(server, tmp_path / "c", prefix, "c")
    await c.look(force=True)
    (entry,) = c.entries()
    assert entry.record["host"] in ("a", "b")
    assert await restored(c, TOKENS) == state(TOKENS)


async def test_a_missing_or_cut_object_is_refused_and_nothing_fails(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a = host(server, tmp_path / "a", prefix, "a")
    save(a, TOKENS)
    await a.upload_pending()
    (entry,) = a.folder.entries()
    names = entry.record["chunks"]["names"]
    bucket = a.remote.bucket
    bucket.put(f"model/chunks/{names[0]}.kv", b"cut short")  # a half-uploaded object
    bucket.delete(f"model/chunks/{names[1]}.kv")
    b = host(server, tmp_path / "b", prefix, "b")
    await b.look(force=True)
    (remote,) = b.entries()
    with pytest.raises(Unreadable, match="lacks"):
        await b.fetch(remote)
    assert b.state == "up" and b.entries() == []  # refused: not offered again, the bucket is not "down"
    c = host(server, tmp_path / "c", prefix, "c")
    bucket.put(f"model/chunks/{names[1]}.kv", b"x" * 10)
    await c.look(force=True)
    fetched = await c.fetch(c.entries()[0])
    with pytest.raises(Unreadable, match=r"damaged|do not make"):
        async with c.local(fetched):
            pass


async def test_the_bucket_going_away_keeps_the_folder_serving_and_the_uploads_resume(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a = host(server, tmp_path / "a", prefix, "a")
    await a.look(force=True)
    server.stop()
    try:
        data = save(a, TOKENS)
        sync = asyncio.ensure_future(a.background())
        for _ in range(100):
            if a.state == "down":
                break
            await asyncio.sleep(0.1)
        assert a.state == "down" and a.error and server.secret_key not in a.error
        assert list(a.pending) and await restored(a, TOKENS) == data  # from the folder
        assert a.evict(0) == []  # the only copy is never evicted
        report = await a.flush(2.0)
        assert report["left"] == 1 and report["error"]
    finally:
        server.start()
    a._poke()
    for _ in range(300):
        if not a.pending and a.state == "up":
            break
        await asyncio.sleep(0.1)
    sync.cancel()
    assert not a.pending and a.state == "up"
    b = host(server, tmp_path / "b", prefix, "b")
    await b.look(force=True)
    assert await restored(b, TOKENS) == data


async def test_what_a_killed_wrapper_had_not_uploaded_goes_up_after_its_restart(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    killed = host(server, tmp_path / "a", prefix, "a")
    data = save(killed, TOKENS)  # committed to the folder; the process dies before its sync uploads it
    assert list(killed.pending)
    again = host(server, tmp_path / "a", prefix, "a")  # the same folder, a new process
    assert again.evict(0) == []  # the bucket not listed yet: nothing it may lack is evicted
    await again.look(force=True)
    assert list(again.pending) == list(killed.pending)
    await again.upload_pending()
    b = host(server, tmp_path / "b", prefix, "b")
    await b.look(force=True)
    assert await restored(b, TOKENS) == data


async def test_a_shorter_state_is_not_sent_again_once_another_host_went_on_with_its_conversation(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a = host(server, tmp_path / "a", prefix, "a")
    save(a, TOKENS[:40])
    await a.upload_pending()
    b = host(server, tmp_path / "b", prefix, "b")  # the conversation moved to b and went on there
    await b.look(force=True)
    save(b, TOKENS[:70])
    await b.upload_pending()  # its shorter state in the bucket is removed
    listed = server._client().list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/")
    names = [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".json")]
    assert len(names) == 1
    again = host(server, tmp_path / "a", prefix, "a")  # a restarts on its folder, which still holds the 40
    await again.look(force=True)
    assert not again.pending
    save(again, TOKENS[:50])  # a state of it made here meanwhile: the bucket's longer one holds it too
    await again.upload_pending()
    listed = server._client().list_objects_v2(Bucket=server.bucket, Prefix=f"{prefix}/")
    assert [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".json")] == names


async def test_an_entry_the_bucket_replaced_with_a_longer_state_since_the_manifests_were_read_brings_that_one(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    """A host's manifests are at most `refresh_s` old: the conversation may have gone on on another host since, and
    the shorter state left the bucket. The fetch takes the longer one, not a prefill."""
    a = host(server, tmp_path / "a", prefix, "a")
    save(a, TOKENS[:40])
    await a.upload_pending()
    c = host(server, tmp_path / "c", prefix, "c")
    await c.look(force=True)
    stale, shared = c.best(TOKENS[:60])
    assert stale is not None and (stale.n_tokens, shared) == (40, 40)
    b = host(server, tmp_path / "b", prefix, "b")  # the conversation goes on on b: its 40 leave the bucket
    await b.look(force=True)
    longer = save(b, TOKENS[:70])
    await b.upload_pending()
    fetched = await c.fetch(stale)
    assert fetched.n_tokens == 70
    async with c.local(fetched) as path:
        assert path.read_bytes() == longer
    gone = host(server, tmp_path / "d", prefix, "d")  # an entry that is just gone, no longer state: refused
    await gone.look(force=True)
    (entry,) = gone.entries()
    server._client().delete_object(Bucket=server.bucket, Key=f"{prefix}/model/{entry.record['file']}")
    with pytest.raises(Unreadable, match="lacks"):
        await gone.fetch(entry)


async def test_slots_ls_opens_the_store_as_the_wrapper_does_and_says_where(
        tmp_path: Path, server: S3Server, prefix: str) -> None:
    a, b = host(server, tmp_path / "a", prefix, "a"), host(server, tmp_path / "b", prefix, "b")
    save(a, TOKENS[:40])
    await a.upload_pending()
    save(b, TOKENS[:70])  # b's own, not uploaded
    config = store_config(tmp_path, server, prefix, tmp_path / "b")
    listed = await asyncio.to_thread(CliRunner().invoke, main, ["slots", "ls", "--config", str(config), "--json"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert sorted((r["tokens"], r["where"]) for r in rows) == [(40, "store"), (70, "local")], listed.output
    assert not any("problem" in r for r in rows)


async def test_slots_ls_on_a_fresh_host_lists_what_the_bucket_holds(tmp_path: Path, server: S3Server,
                                                                    prefix: str) -> None:
    a = host(server, tmp_path / "a", prefix, "a")
    save(a, TOKENS[:40])
    await a.upload_pending()
    fresh = tmp_path / "fresh"  # the host a conversation moves to: no model folder yet
    config = store_config(tmp_path, server, prefix, fresh)
    listed = await asyncio.to_thread(CliRunner().invoke, main, ["slots", "ls", "--config", str(config), "--json"])
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(r["model_id"], r["tokens"], r["where"]) for r in rows] == [("model", 40, "store")], listed.output
    assert not fresh.exists()  # a listing writes nothing


def test_check_says_which_endpoint_and_credentials_and_probe_tries_them(
        tmp_path: Path, server: S3Server, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = store_config(tmp_path, server, prefix, tmp_path / "slots")
    probed = CliRunner().invoke(main, ["check", str(config), "--probe"])
    assert probed.exit_code == 0, probed.output
    store = yaml.safe_load(probed.output)["reaches"]["store"]
    assert store["endpoint"] == server.endpoint and store["endpoint_from"] == "store.endpoint"
    assert store["credentials"] == "store.access_key and store.secret_key of the config"
    assert store["probe"].startswith("ok: listed") and server.secret_key not in probed.output
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    config.write_text(f"slots: {{dir: {tmp_path / 'slots'}}}\nstore: {{url: {server.store(prefix)}, "
                      "region: us-east-1, timeout: 2s}\n")
    failed = CliRunner().invoke(main, ["check", str(config), "--probe"])
    store = yaml.safe_load(failed.output)["reaches"]["store"]
    assert failed.exit_code == 1 and store["probe"].startswith("failed: ")
    assert (store["endpoint"], store["endpoint_from"]) == ("http://127.0.0.1:9", "AWS_ENDPOINT_URL")
    assert store["credentials"] == "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    assert "reaches" not in CliRunner().invoke(main, ["check", str(tmp_path / "none.yaml")]).output
