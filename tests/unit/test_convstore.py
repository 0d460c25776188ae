"""The conversation cache's folder: entries committed as pairs, found by prefix, evicted by last use, never a
half-written file read, shared by writers."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hooks.convstore import Store, common_prefix, key_of, part_name
from tests.slotfiles import slot_bytes

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16"}


def written(store: Store, tokens: list[int], cells: int = 4) -> Path:
    """What llama-server writes for a save: a state file under a part name."""
    part = store.directory / part_name(key_of(tokens))
    part.write_bytes(slot_bytes(tokens, cells=cells))
    return part


def test_an_entry_is_found_by_its_longest_shared_prefix(tmp_path: Path) -> None:
    store = Store(tmp_path)
    one, two = [1, 2, 3, 4, 5], [1, 2, 9, 9]
    store.commit(written(store, one), one, RECORD)
    store.commit(written(store, two), two, RECORD)
    entry, shared = store.best([1, 2, 3, 4, 5, 6, 7])
    assert entry is not None and entry.tokens == one and shared == 5
    assert store.find(two) is not None and store.find([1, 2]) is None
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0


def test_a_longer_state_of_a_conversation_replaces_the_shorter(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.commit(written(store, [1, 2, 3]), [1, 2, 3], RECORD)
    store.commit(written(store, [1, 2, 3, 4, 5]), [1, 2, 3, 4, 5], RECORD)
    assert [e.tokens for e in store.entries()] == [[1, 2, 3, 4, 5]]
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["conv", "conv"]  # one pair, no litter


def test_the_least_recently_used_go_first(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for n in range(4):
        tokens = [100 * n + i for i in range(5)]
        entry = store.commit(written(store, tokens), tokens, RECORD)
        os.utime(entry.sidecar, (time.time() - 100 + n, time.time() - 100 + n))
    oldest = min(store.entries(), key=lambda e: e.last_used)
    store.touch(oldest)  # a hit makes it the most recent
    size = store.entries()[0].bytes
    removed = store.evict(2 * size)
    assert len(removed) == 2 and oldest.key not in {e.key for e in removed}
    assert store.total_bytes() <= 2 * size


def test_two_writers_of_one_conversation_leave_one_whole_entry(tmp_path: Path) -> None:
    first, second = Store(tmp_path), Store(tmp_path)  # two wrappers on one folder
    tokens = [7, 8, 9]
    a = written(first, tokens)
    b = a.with_name(a.name.replace(f"-{os.getpid()}", "-1"))
    b.write_bytes(slot_bytes(tokens, cells=5))  # the other writer's file differs
    first.commit(a, tokens, RECORD)
    second.commit(b, tokens, RECORD)
    (entry,) = first.entries()  # the other wrapper's commit is seen
    assert entry.kv_file.stat().st_size == len(slot_bytes(tokens, cells=5)) and entry.tokens == tokens


def test_what_no_reader_may_use_is_left_alone_or_swept(tmp_path: Path) -> None:
    store = Store(tmp_path)
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
