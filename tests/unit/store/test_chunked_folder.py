"""The folder store with chunks: a new turn writes only what it adds, conversations with one beginning share it,
a restore reads back the very state, a manifest never names a chunk that is not whole, what nobody names goes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from hooks.store import chunk_folder as chunkdir
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.interface import Entry, Unreadable
from tests.slotfiles import kv_state as state

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16"}
CHUNK = 16


def save(store: DirectoryStore, tokens: list[int], **layout: object) -> tuple[bytes, int]:
    """Commit what llama-server would write for these tokens; the state and what the commit wrote."""
    data = state(tokens, **layout)  # type: ignore[arg-type]
    part = store.directory / part_name("test")
    part.write_bytes(data)
    entry = store.commit(part, tokens, RECORD)
    assert not part.exists()
    return data, entry.written


def restored(store: DirectoryStore, tokens: list[int]) -> bytes:
    entry = store.find(tokens)
    assert entry is not None
    return read(store, entry)


def read(store: DirectoryStore, entry: Entry) -> bytes:
    async def handed_over() -> bytes:
        async with store.local(entry) as path:
            return path.read_bytes()
    return asyncio.run(handed_over())


def conversation(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_a_new_turn_writes_only_the_chunks_it_adds(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    first, wrote_first = save(store, conversation(70))
    assert restored(store, conversation(70)) == first
    second, wrote_second = save(store, conversation(90))
    assert restored(store, conversation(90)) == second
    per_token = len(second) / 90
    assert wrote_first < len(first) + 2000  # the state once, and its manifest
    assert wrote_second < 40 * per_token  # 16 new in a chunk, a tail of 10, header and manifest: not 90 tokens
    assert [e.n_tokens for e in store.entries()] == [90]  # the shorter state went, the chunks it shared stayed
    assert len(list((tmp_path / "chunks").iterdir())) == 5


def test_conversations_with_one_beginning_share_its_chunks(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    system = conversation(48)
    save(store, [*system, *conversation(30, 5000)])
    data, wrote = save(store, [*system, *conversation(30, 7000)])
    assert wrote < len(data) * 0.6  # the shared beginning (3 of its 4 chunks) is not written again
    assert len(list((tmp_path / "chunks").iterdir())) == 3 + 2 * 1  # 3 shared, one of its own each
    for other in (5000, 7000):
        tokens = [*system, *conversation(30, other)]
        assert restored(store, tokens) == state(tokens)
    # removing one keeps what the other names
    entry = store.find([*system, *conversation(30, 5000)])
    assert entry is not None
    os.utime(tmp_path / "chunks", None)
    store.remove(entry)
    tokens = [*system, *conversation(30, 7000)]
    assert restored(store, tokens) == state(tokens)


@pytest.mark.parametrize("layout", [{"v_trans": True}, {"k_type": 8, "row": 34}, {"k_type": 2, "row": 18},
                                    {"swa": (50, 2)}, {"cell_ext": 12}])
def test_every_layout_comes_back(tmp_path: Path, layout: dict[str, object]) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    data, _ = save(store, conversation(70), **layout)
    assert restored(store, conversation(70)) == data


def test_a_conversation_shorter_than_a_chunk_is_kept_whole(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    data, _ = save(store, conversation(10))
    (entry,) = store.entries()
    assert "chunks" not in entry.record and not (tmp_path / "chunks").exists()
    assert (tmp_path / entry.name).read_bytes() == data and restored(store, conversation(10)) == data


def test_entries_written_whole_are_still_read(tmp_path: Path) -> None:
    DirectoryStore(tmp_path)  # a wrapper before chunks
    whole = DirectoryStore(tmp_path)
    data, _ = save(whole, conversation(70))
    chunked = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    assert restored(chunked, conversation(70)) == data
    longer, _ = save(chunked, conversation(90))  # its next turn is chunked; the whole state goes
    assert restored(chunked, conversation(90)) == longer and len(chunked.entries()) == 1


def test_a_missing_or_damaged_chunk_makes_the_entry_unreadable(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    save(store, conversation(70))
    (entry,) = store.entries()
    names = entry.record["chunks"]["names"]
    chunk = tmp_path / "chunks" / f"{names[1]}.kv"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    with pytest.raises(Unreadable, match="damaged"):
        read(store, entry)
    chunk.unlink()
    with pytest.raises(Unreadable, match="missing"):
        read(store, entry)
    assert not list(tmp_path.glob("*.part-*"))  # no assembled part left behind


def test_a_hostile_manifest_cannot_name_a_file_outside_the_chunks(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    save(store, conversation(70))
    (entry,) = store.entries()
    entry.record["chunks"]["names"][0] = "../../etc/passwd"
    sidecar = tmp_path / f"conv-{entry.key}.json"
    data = json.loads(sidecar.read_text())
    data["chunks"]["names"][0] = "../../etc/passwd"
    sidecar.write_text(json.dumps(data))
    fresh = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    assert fresh.entries() == []  # never offered
    entry_file = tmp_path / entry.name
    assert fresh.sweep() is not None and entry_file.exists()  # nothing outside the chunks is touched either


def test_the_budget_counts_each_chunk_once_and_unnamed_chunks_go_first(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    system = conversation(64)
    for other in range(4):
        save(store, [*system, *conversation(20, 5000 + 100 * other)])
    used = store.used_bytes()
    assert used < sum(e.bytes for e in store.entries()) * 0.5  # 4 entries share 4 of their 5 chunks
    stray = tmp_path / "chunks" / ("f" * 32 + ".kv")
    stray.write_bytes(b"x" * 100_000)  # a chunk no manifest names (a writer killed before its manifest)
    old = time.time() - 2 * chunkdir.GRACE_S
    os.utime(stray, (old, old))
    assert store.used_bytes() == used + 100_000
    assert store.evict(used + 100_000) == [] and stray.exists()  # within the budget: nothing goes
    assert store.evict(used + 99_999) == []  # the stray alone makes room
    assert not stray.exists() and store.used_bytes() == used
    oldest = store.evict(store.used_bytes() - 1)
    assert len(oldest) == 1 and len(store.entries()) == 3


def test_a_kill_between_the_chunks_and_the_manifest_leaves_the_store_whole(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    data, _ = save(store, conversation(70))
    # another process writes the chunks of a longer state and is killed before its manifest
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
from pathlib import Path
from hooks.store import layout
from hooks.store.folder import DirectoryStore, part_name
from tests.slotfiles import kv_state as state
store = DirectoryStore(Path({str(tmp_path)!r}), chunk_tokens={CHUNK})
tokens = list(range(1000, 1100))
part = store.directory / part_name("killed")
part.write_bytes(state(tokens))
layout.commit_pair = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
store.commit(part, tokens, {{"model": {{"id": "m1", "name": "m"}}, "cache_type_k": "f16", "cache_type_v": "f16"}})
"""
    done = subprocess.run([sys.executable, "-c", script], check=False)
    assert done.returncode == -9
    fresh = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    assert [e.n_tokens for e in fresh.entries()] == [70] and restored(fresh, conversation(70)) == data
    assert len(list((tmp_path / "chunks").glob("*.kv"))) == 6  # 4 named, 2 of the killed commit
    later = time.time() + chunkdir.ORPHAN_AGE_S + 1
    removed = fresh.sweep(later)
    assert len([r for r in removed if r.startswith("chunks/")]) == 2
    assert restored(fresh, conversation(70)) == data


def test_the_chunks_of_a_manifest_this_reader_cannot_use_are_kept(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    save(store, conversation(70))
    (entry,) = store.entries()
    sidecar = tmp_path / f"conv-{entry.key}.json"
    data = json.loads(sidecar.read_text())
    data["chunks"]["format"], data["chunks"]["count"] = 2, "a newer layout"  # a newer wrapper's manifest
    sidecar.write_text(json.dumps(data))
    fresh = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    assert fresh.entries() == []
    fresh.sweep(time.time() + chunkdir.ORPHAN_AGE_S + 1)
    assert len(list((tmp_path / "chunks").glob("*.kv"))) == 4


def test_threads_committing_one_shared_beginning_at_once_leave_every_entry_whole(tmp_path: Path) -> None:
    """Two slots saving conversations with one system prompt write its chunks at the same moment (each commit
    runs on a worker thread): each writes a temporary of its own."""
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    system = conversation(64)
    tails = [conversation(20, 5000 + 100 * n) for n in range(8)]
    datas = {n: state([*system, *tail]) for n, tail in enumerate(tails)}

    def commit(n: int) -> None:
        part = tmp_path / part_name(f"t{n}")
        part.write_bytes(datas[n])
        store.commit(part, [*system, *tails[n]], RECORD)

    threads = [threading.Thread(target=commit, args=(n,)) for n in range(8)]
    for each in threads:
        each.start()
    for each in threads:
        each.join()
    assert len(store.entries()) == 8
    for n, tail in enumerate(tails):
        assert restored(store, [*system, *tail]) == datas[n]
    assert not list((tmp_path / "chunks").glob("*.tmp"))


def _sidecar(store: DirectoryStore, tokens: list[int]) -> tuple[Entry, Path, dict[str, object]]:
    entry = store.find(tokens)
    assert entry is not None
    path = store.directory / f"conv-{entry.key}.json"
    return entry, path, json.loads(path.read_text())


def test_a_manifest_whose_chunk_names_are_not_its_tokens_is_refused(tmp_path: Path) -> None:
    """A manifest naming its second chunk twice would restore positions 16-31 twice and 0-15 never."""
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    save(store, conversation(70))
    entry, path, record = _sidecar(store, conversation(70))
    plan = cast(dict[str, Any], record["chunks"])
    plan["names"] = [plan["names"][1], *plan["names"][1:]]
    path.write_text(json.dumps(record))
    again = store.get(entry.key)
    assert again is not None
    with pytest.raises(Unreadable, match=r"names chunk 1 of 4 .* not this conversation's state"):
        read(store, again)
    assert store.problem(again) == "its chunk names are not its tokens' (not this conversation's state)"
    assert not list(tmp_path.glob("*.part-*"))  # nothing assembled is left behind


@pytest.mark.parametrize(("damage", "cause"), [
    (lambda r: r.update(file="../outside.bin"), "names an odd file: '../outside.bin'"),
    (lambda r: r["chunks"]["names"].__setitem__(0, "../../outside"), "names that are not chunk names"),
    (lambda r: r["chunks"].update(count=r["chunks"]["count"] + 1), "4 chunk names for a count of 5"),
    (lambda r: r.update(chunks="a string"), "a chunk plan that is not one (str)"),
])
def test_a_sidecar_the_folder_rejects_says_why_and_touches_nothing_outside(
        tmp_path: Path, damage: Any, cause: str) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not ours")
    store = DirectoryStore(folder, chunk_tokens=CHUNK)
    save(store, conversation(70))
    entry, path, record = _sidecar(store, conversation(70))
    damage(record)
    path.write_text(json.dumps(record))
    store = DirectoryStore(folder, chunk_tokens=CHUNK)  # another process reads it as it is now
    assert store.entries() == []  # never offered to a lookup
    noted = store.get(entry.key)  # but a host's note may name it
    assert noted is not None and noted.problem is not None and cause in noted.problem
    with pytest.raises(Unreadable) as refused:
        read(store, noted)
    assert cause in str(refused.value) and "bytes recorded" not in str(refused.value)
    store.remove(noted)
    assert outside.read_bytes() == b"not ours" and not path.exists()


def test_a_private_entry_is_its_consumers_alone(tmp_path: Path) -> None:
    """Under consumers.isolate two consumers' same conversation are two entries with their own chunks: neither is
    found for the other, and removing one leaves the other whole."""
    store = DirectoryStore(tmp_path, chunk_tokens=CHUNK)
    tokens = conversation(70)
    for who in ("alice", "bob"):
        data = state(tokens)
        part = store.directory / part_name("test")
        part.write_bytes(data)
        store.commit(part, tokens, {**RECORD, "consumer": who, "private": True})
    alice, bob = store.find(tokens, "alice"), store.find(tokens, "bob")
    assert alice is not None and bob is not None and alice.key != bob.key
    assert store.find(tokens) is None  # nobody's: a lookup without the owner finds neither
    assert (alice.consumer, bob.consumer) == ("alice", "bob")
    assert not set(chunkdir.names_of(alice.record)) & set(chunkdir.names_of(bob.record))
    os.utime(tmp_path / "chunks", None)
    store.remove(alice)
    assert read(store, bob) == state(tokens) and store.find(tokens, "alice") is None
