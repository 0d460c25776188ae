"""The store as a folder: entries committed as pairs, found by prefix, evicted by last use, never a
half-written file read, shared by writers, listed again only when the folder changed; hosts' notes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.store import layout
from hooks.store.chunk_folder import names_of
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.interface import Forgotten, Shares, common_prefix, held_within
from tests.slotfiles import make_pair, slot_bytes

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16"}


def written(store: DirectoryStore, tokens: list[int], cells: int = 4) -> Path:
    """What llama-server writes for a save: a state file under a part name."""
    part = store.directory / part_name("test")
    part.write_bytes(slot_bytes(tokens, cells=cells))
    return part


def test_an_entry_is_found_by_its_longest_shared_prefix(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    one, two = [1, 2, 3, 4, 5], [1, 2, 9, 9]
    store.commit(written(store, one), one, RECORD)
    store.commit(written(store, two), two, RECORD)
    entry, shared = store.best([1, 2, 3, 4, 5, 6, 7])
    assert entry is not None and entry.tokens == one and shared == 5
    assert store.find(two) is not None and store.find([1, 2]) is None
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_a_longer_state_of_a_conversation_replaces_the_shorter(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    store.commit(written(store, [1, 2, 3]), [1, 2, 3], RECORD)
    store.commit(written(store, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5], RECORD)
    assert [e.tokens for e in store.entries()] == [[1, 2, 3, 4, 5]]
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["conv", "conv"]  # one pair, no litter


def test_a_shorter_state_replaced_while_it_commits_gives_the_longer_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots paused at once holding one conversation (two agents asked the same): the longer state's commit
    removes the shorter one between its files' writing and its listing (each commit on its own thread)."""
    store = DirectoryStore(tmp_path)
    shorter, longer = [1, 2, 3], [1, 2, 3, 4, 5]
    commit_pair = layout.commit_pair

    def the_longer_commits_meanwhile(*args: object, **kwargs: object) -> Path:
        final = commit_pair(*args, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(layout, "commit_pair", commit_pair)
        store.commit(written(store, longer), longer, RECORD)
        return final

    monkeypatch.setattr(layout, "commit_pair", the_longer_commits_meanwhile)
    entry = store.commit(written(store, shorter), shorter, RECORD)
    assert entry.tokens == longer  # the store holds it, in the longer state
    assert [e.tokens for e in store.entries()] == [longer]


def test_the_least_recently_used_go_first(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    for n in range(4):
        tokens = [100 * n + i for i in range(5)]
        entry = store.commit(written(store, tokens), tokens, RECORD)
        os.utime(tmp_path / f"conv-{entry.key}.json", (time.time() - 100 + n, time.time() - 100 + n))
    oldest = min(DirectoryStore(tmp_path).entries(), key=lambda e: e.last_used)
    store.touch(oldest)  # a hit makes it the most recent
    size = store.entries()[0].bytes
    removed = store.evict(2 * size)
    assert len(removed) == 2 and oldest.key not in {e.key for e in removed}
    assert sum(e.bytes for e in store.entries()) <= 2 * size


def test_two_writers_of_one_conversation_leave_one_whole_entry(tmp_path: Path) -> None:
    first, second = DirectoryStore(tmp_path), DirectoryStore(tmp_path)  # two wrappers on one folder
    tokens = [7, 8, 9]
    a = written(first, tokens)
    b = a.with_name(a.name.replace(f"-{os.getpid()}", "-1"))
    b.write_bytes(slot_bytes(tokens, cells=5))  # the other writer's file differs
    first.commit(a, tokens, RECORD)
    second.commit(b, tokens, RECORD)
    (entry,) = first.entries()  # the other wrapper's commit is seen
    assert (first.directory / entry.name).stat().st_size == len(slot_bytes(tokens, cells=5)) and entry.tokens == tokens


def test_a_listing_is_kept_until_the_folder_changes_or_grows_old(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    reader, writer = DirectoryStore(tmp_path, relist_s=30, clock=lambda: now[0]), DirectoryStore(tmp_path)
    writer.commit(written(writer, [1, 2, 3]), [1, 2, 3], RECORD)
    assert len(reader.entries()) == 1
    globbed: list[str] = []
    original = Path.glob

    def counted(self: Path, pattern: str) -> Iterator[Path]:
        globbed.append(pattern)
        return original(self, pattern)

    monkeypatch.setattr(Path, "glob", counted)
    assert len(reader.entries()) == 1 and not globbed  # nothing changed: no listing
    writer.commit(written(writer, [4, 5, 6]), [4, 5, 6], RECORD)  # another host commits
    globbed.clear()
    assert reader.best([4, 5, 6, 7])[1] == 3 and len(globbed) == 1  # seen at the next lookup
    os.utime(tmp_path, (1.0, 1.0))  # a folder whose mtime says nothing new (an attribute cache): its age does
    reader.entries()
    globbed.clear()
    assert len(reader.entries()) == 2 and not globbed
    now[0] = 31.0
    assert len(reader.entries()) == 2 and len(globbed) == 1


def test_each_host_notes_what_its_slots_held_and_a_host_without_a_note_takes_the_newest(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    x = store.commit(written(store, [1, 2, 3]), [1, 2, 3], RECORD)
    y = store.commit(written(store, [4, 5, 6]), [4, 5, 6], RECORD)
    assert store.note("hosta", {0: x}) and store.note("hostb", {0: y, 1: x})
    assert not store.note("hostb", {1: x})  # says so already: nothing written
    assert [(h.slot, h.key) for h in store.held("hosta")] == [(0, x.key)]
    assert [(h.slot, h.key) for h in store.held("hostb")] == [(0, y.key), (1, x.key)]
    os.utime(tmp_path / "held-hosta.json", (time.time() + 5, time.time() + 5))
    assert [h.key for h in store.held("newhost")] == [x.key]
    store.remove(y)
    assert [(h.slot, h.entry) for h in store.held("hostb")] == [(0, None), (1, x)]  # gone: said, not hidden


def test_a_pair_of_the_earlier_layout_is_held_until_its_slot_is_noted(tmp_path: Path) -> None:
    make_pair(tmp_path, "m1", 0, [1, 2])
    make_pair(tmp_path, "m1", 1, [3, 4])
    store = DirectoryStore(tmp_path)
    held = store.held(layout.host_id())
    assert [(h.slot, h.entry is not None and h.entry.by_content) for h in held] == [(0, False), (1, False)]
    assert held[0].entry is not None and held[0].entry.tokens == [1, 2] and not store.entries()
    entry = store.commit(written(store, [1, 2, 9]), [1, 2, 9], RECORD)
    store.note(layout.host_id(), {0: entry})
    assert [(h.slot, h.key) for h in store.held(layout.host_id())] == [(0, entry.key), (1, "slot1")]
    assert not (tmp_path / "slot0.json").exists() and (tmp_path / "slot1.json").exists()


def test_what_no_reader_may_use_is_left_alone_or_swept(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    store.commit(written(store, [1, 2, 3]), [1, 2, 3], RECORD)
    (tmp_path / "conv-0123456789abcdef.json").write_text("{not json")  # a damaged sidecar: skipped
    host = part_name("x").split(".part-")[1].rsplit("-", 1)[0]
    dead = tmp_path / f"conv-{'a' * 16}.bin.part-{host}-999999"  # a writer on this host that died
    dead.write_bytes(b"half")
    orphan = tmp_path / f"conv-{'b' * 16}-{'c' * 12}.bin"
    orphan.write_bytes(b"no sidecar names me")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    assert [e.tokens for e in store.entries()] == [[1, 2, 3]]
    assert sorted(store.sweep()) == sorted([dead.name, orphan.name])
    assert [e.tokens for e in store.entries()] == [[1, 2, 3]]


def test_a_consumer_over_its_share_loses_its_own_oldest_and_one_within_keeps_what_it_has(tmp_path: Path) -> None:
    """consumers.shares: the agent's share holds two entries; the people have none of their own beyond the budget,
    and the one with a share is taken last."""
    store = DirectoryStore(tmp_path)
    ages = iter(range(100))

    def keep(consumer: str, n: int) -> str:
        tokens = [1000 * n + i for i in range(5)]
        entry = store.commit(written(store, tokens), tokens, {**RECORD, "consumer": consumer})
        when = time.time() - 200 + next(ages)
        os.utime(tmp_path / f"conv-{entry.key}.json", (when, when))
        return entry.key

    alice = [keep("alice", n) for n in range(2)]  # the oldest of all
    bob = [keep("bob", n) for n in range(2, 4)]
    agent = [keep("agent", n) for n in range(4, 10)]  # the flood
    size = DirectoryStore(tmp_path).entries()[0].bytes
    shares = Shares(folder={"agent": 2 * size, "alice": 2 * size})
    gone = {e.key for e in store.evict(100 * size, shares=shares)}  # the budget is far: the agent's share alone
    assert gone == set(agent[:4])
    gone = {e.key for e in store.evict(5 * size, shares=shares)}  # now the budget: bob (no share) before alice
    assert gone == {bob[0]}
    assert {e.key for e in store.entries()} == {*alice, bob[1], *agent[4:]}
    assert held_within(store.entries(), {"alice": size}, {alice[0]}) == [store.get(alice[1])]


@pytest.mark.parametrize("chunk_tokens", [0, 2])
def test_a_save_taken_before_its_consumer_was_forgotten_never_commits(tmp_path: Path, chunk_tokens: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A save races a forget of its consumer: the state was taken from its slot (`saved_at`) before the forget, its
    files are written while the forget runs (between the pair's writing and the listing) or after it. Neither
    commit leaves an entry, a pair or a chunk; a state taken after the forget is kept, and so is another
    consumer's."""
    store = DirectoryStore(tmp_path, chunk_tokens=chunk_tokens)
    taken = time.time()
    alice = {**RECORD, "consumer": "alice", "private": True, "saved_at": taken}
    bobs = [7, 7, 7, 7]
    store.commit(written(store, bobs), bobs, {**RECORD, "consumer": "bob", "saved_at": taken})
    commit_pair = layout.commit_pair

    def forgotten_meanwhile(*args: object, **kwargs: object) -> Path:
        final = commit_pair(*args, **kwargs)  # type: ignore[arg-type]
        monkeypatch.setattr(layout, "commit_pair", commit_pair)
        store.forget("alice")
        return final

    monkeypatch.setattr(layout, "commit_pair", forgotten_meanwhile)
    with pytest.raises(Forgotten, match="alice"):
        store.commit(written(store, [1, 2, 3, 4]), [1, 2, 3, 4], alice)
    with pytest.raises(Forgotten, match="alice"):  # one taken before, committed after the forget
        store.commit(written(store, [1, 2, 3, 4, 5, 6]), [1, 2, 3, 4, 5, 6], {**alice, "consumer": "alice#a1b2"})
    assert [e.named for e in store.entries()] == ["bob"]
    names = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert len([n for n in names if n.startswith("conv-")]) == 2  # bob's pair, nothing else
    assert {p.name[:-3] for p in tmp_path.rglob("chunks/*.kv")} == set(names_of(store.entries()[0].record))
    later = [1, 2, 3, 4, 5]
    entry = store.commit(written(store, later), later, {**alice, "saved_at": time.time() + 1})
    assert entry.named == "alice" and sorted(e.named or "" for e in store.entries()) == ["alice", "bob"]
