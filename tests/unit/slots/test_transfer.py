"""One restore into a slot, wherever it runs (a start, a reload, before a request): a server that dies under
it is noticed and the entry set aside, a refusal is a refusal, a damaged entry says so; one save into the
store, which writes nothing the store holds already."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from hooks.slots.book import book_of
from hooks.slots.transfer import NotRestored, restore_into, save_into
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.interface import Entry
from tests.slotfiles import slot_bytes
from wrapper.kept import Kept
from wrapper.server.generation import Generation, ServerLost
from wrapper.server.llama import LlamaError

RECORD = {"model": {"id": "m1", "name": "m"}, "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "on",
          "kv_streams": 1}


class Child:
    def __init__(self) -> None:
        self.alive, self.lines_seen = True, 0

    def lines_since(self, mark: int) -> list[str]:
        return [] if self.alive else ["llama-server: GGML_ASSERT failed in state read"]


class Client:
    """llama-server's slot actions as a test scripts them: `restore` is "ok", "refuse" or "die"."""

    def __init__(self, child: Child, folder: Path, restore: str = "ok", saves: list[int] | None = None) -> None:
        self.child, self.folder, self.restore, self.saves = child, folder, restore, saves or []
        self.calls: list[tuple[str, str | None]] = []

    async def props(self) -> dict[str, Any]:
        return {"total_slots": 1, "default_generation_settings": {"n_ctx": 4096}, "build_info": "b0"}

    async def slot_action(self, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
        self.calls.append((action, filename))
        if action == "save":
            tokens = self.saves
            (self.folder / str(filename)).write_bytes(slot_bytes(tokens))
            return {"n_saved": len(tokens)}
        if self.restore == "die":
            self.child.alive = False
            raise LlamaError("cannot reach llama-server: Server disconnected")
        if self.restore == "refuse":
            raise LlamaError("failed to restore slot", 400)
        return {"n_restored": 3, "timings": {"restore_ms": 1.0}}


def fake_generation(folder: Path, restore: str = "ok", saves: list[int] | None = None) -> Generation:
    child = Child()
    launch = SimpleNamespace(argv=["llama-server"], env={}, facts={}, model=SimpleNamespace(
        id="m1", as_dict=lambda: {"id": "m1", "name": "m"}))
    client = Client(child, folder, restore, saves)
    return cast(Generation, SimpleNamespace(child=child, client=client, launch=launch, state=Kept(), shared=Kept(),
                                            props=client.props))


def entry_in(store: DirectoryStore, tokens: list[int], **record: Any) -> Entry:
    part = store.directory / part_name("test")
    part.write_bytes(slot_bytes(tokens))
    return store.commit(part, tokens, {**RECORD, **record})


async def test_a_restore_tells_the_book_what_the_slot_holds(tmp_path: Path) -> None:
    store, generation = DirectoryStore(tmp_path), fake_generation(tmp_path)
    entry = entry_in(store, [1, 2, 3])
    book_of(generation).pinned()
    done = await restore_into(generation, store, entry, 0)
    book = book_of(generation)
    assert done.n_restored == 3 and book.entry_of(0) == entry.key and book.holds(0) == [1, 2, 3]
    assert cast(Client, generation.client).calls == [("restore", entry.name)]


async def test_a_server_that_dies_under_a_restore_is_noticed_and_the_entry_set_aside(tmp_path: Path) -> None:
    store, generation = DirectoryStore(tmp_path), fake_generation(tmp_path, restore="die")
    entry = entry_in(store, [1, 2, 3])
    with pytest.raises(ServerLost, match="set aside"):
        await restore_into(generation, store, entry, 0)
    assert store.get(entry.key) is None and not store.entries()  # no lookup finds it again
    (reason,) = (tmp_path / "set-aside").glob("*.reason.txt")
    assert "llama-server died restoring it" in reason.read_text() and "GGML_ASSERT" in reason.read_text()


async def test_a_refusal_and_a_damaged_entry_are_not_restored_and_say_why(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    entry = entry_in(store, [1, 2, 3])
    with pytest.raises(NotRestored) as refused:
        await restore_into(fake_generation(tmp_path, restore="refuse"), store, entry, 0)
    assert refused.value.failed and "the server refused it" in refused.value.reason
    assert store.get(entry.key) is not None  # a refusal is not the entry's fault
    (tmp_path / entry.name).write_bytes(b"cut")
    with pytest.raises(NotRestored) as damaged:
        await restore_into(fake_generation(tmp_path), store, entry, 0)
    assert damaged.value.damaged and "an interrupted save?" in damaged.value.reason
    other = entry_in(store, [7, 8], model={"id": "m2", "name": "other"})
    with pytest.raises(NotRestored) as foreign:
        await restore_into(fake_generation(tmp_path), store, other, 0)
    assert not foreign.value.damaged and foreign.value.reason.startswith("other model")


async def test_a_save_of_what_the_store_holds_writes_nothing(tmp_path: Path) -> None:
    store, generation = DirectoryStore(tmp_path), fake_generation(tmp_path, saves=[1, 2, 3])
    saved = await save_into(generation, store, 0)
    assert saved is not None and saved.new and book_of(generation).holds(0) == [1, 2, 3]
    again = await save_into(fake_generation(tmp_path, saves=[1, 2, 3]), store, 0)
    assert again is not None and not again.new and again.entry.key == saved.entry.key
    assert len(store.entries()) == 1 and not list(tmp_path.glob("*.part-*"))  # parts never stay
    assert await save_into(fake_generation(tmp_path, saves=[]), store, 0) is None  # an empty slot


def old_entry(store: DirectoryStore, tokens: list[int], k_type: int = 1, **record: Any) -> Entry:
    """An entry as llama.cpp b9095 wrote it: state version 2, plain tokens."""
    part = store.directory / part_name("old")
    part.write_bytes(slot_bytes(tokens, version=2, server_state=False, k_type=k_type, row=64))
    return store.commit(part, tokens, {**RECORD, "build": "b9095", **record})


async def test_an_older_builds_entry_is_converted_and_replaced_only_once_the_server_took_it(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    entry = old_entry(store, [1, 2, 3])
    refusing = fake_generation(tmp_path, restore="refuse")
    book_of(refusing).learnt_version(4)
    with pytest.raises(NotRestored) as refused:
        await restore_into(refusing, store, entry, 0)
    assert refused.value.failed  # the converted state was refused: the older build's file is what is kept
    kept = store.get(entry.key)
    assert kept is not None and (tmp_path / kept.name).read_bytes()[4:8] == (2).to_bytes(4, "little")
    assert [e.key for e in store.entries()] == [entry.key] and not list(tmp_path.glob("*.tmp"))
    taking = fake_generation(tmp_path)
    book_of(taking).learnt_version(4)
    done = await restore_into(taking, store, entry, 0)
    assert done.conversion is not None and "state version 2 (build b9095)" in done.conversion["from"]
    assert done.header.version == 4 and done.entry.record["state_version"] == 4
    assert [(tmp_path / e.name).read_bytes()[4:8] for e in store.entries()] == [(4).to_bytes(4, "little")]
    action, name = cast(Client, taking.client).calls[-1]
    assert action == "restore" and name is not None and "converted" in name  # the conversion, before its commit


async def test_a_quantized_entry_of_an_older_build_is_not_converted_without_the_head_size(tmp_path: Path) -> None:
    store = DirectoryStore(tmp_path)
    entry = old_entry(store, [1, 2, 3], k_type=8, cache_type_k="q8_0", cache_type_v="q8_0")
    generation = fake_generation(tmp_path)  # facts: {} (a model the wrapper could not read): the rotation is not known
    book_of(generation).learnt_version(4)
    with pytest.raises(NotRestored) as skipped:
        await restore_into(generation, store, entry, 0)
    assert skipped.value.warmable and "head size is not known" in str(skipped.value.conversion)
    assert cast(Client, generation.client).calls == [] and store.get(entry.key) is not None
