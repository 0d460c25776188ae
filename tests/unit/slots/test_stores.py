"""The store of a slot folder: opened once by the slot built-ins' fit, never on a request; what this host's note
says its slots held sizes a start, a conversation only the bucket may hold included."""

from __future__ import annotations

from pathlib import Path

from hooks.slots.stores import noted_tokens, open_for, store_of
from hooks.store import layout
from hooks.store.folder import DirectoryStore, part_name
from hooks.store.settings import StoreSettings
from tests.slotfiles import slot_bytes
from wrapper.configuration.config import Config, Listen
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model


def _launch(folder: Path) -> Launch:
    return Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 2), model=Model(None, "m", "m1"),
                  env={}, fitted={"slots": folder})


def _noted(folder: Path) -> None:
    """This host's note: slot 0 holds a conversation of 3 tokens on disk, slot 1 one of 900 tokens the folder
    no longer holds (another host's folder, or the bucket)."""
    store = DirectoryStore(folder)
    part = folder / part_name("test")
    part.write_bytes(slot_bytes([1, 2, 3]))
    here = store.commit(part, [1, 2, 3], {"model": {"id": "m1", "name": "m"}})
    layout.write_note(folder, layout.host_id(), {0: layout.NoteLine(0, here.key, 3),
                                                 1: layout.NoteLine(1, "00000000000000aa", 900)})


def test_a_folder_is_opened_once_and_found_by_its_generations(tmp_path: Path) -> None:
    shared, config = Kept(), Config()
    first = open_for(shared, tmp_path, config)
    assert open_for(shared, tmp_path, config) is first and open_for(shared, tmp_path / "other", config) is not first
    generation = type("G", (), {"launch": _launch(tmp_path), "shared": shared})()
    assert store_of(generation) is first
    nothing = type("G", (), {"launch": _launch(tmp_path), "shared": Kept()})()
    assert store_of(nothing) is None  # never opened on a request


def test_a_start_is_sized_by_what_the_folder_holds_of_the_note(tmp_path: Path) -> None:
    _noted(tmp_path)
    shared = Kept()
    open_for(shared, tmp_path, Config())
    assert noted_tokens(_launch(tmp_path), shared) == [3]


def test_with_a_bucket_behind_the_folder_a_conversation_only_the_bucket_may_hold_counts(tmp_path: Path) -> None:
    _noted(tmp_path)
    shared = Kept()
    behind = StoreSettings(url="s3://llm-kv/conversations", endpoint="http://127.0.0.1:9")  # never asked here
    open_for(shared, tmp_path, Config(settings={"store": behind}))
    assert sorted(noted_tokens(_launch(tmp_path), shared)) == [3, 900]


def test_a_plan_reads_the_folder_alone(tmp_path: Path) -> None:
    _noted(tmp_path)
    shared = Kept()
    behind = StoreSettings(url="s3://llm-kv/conversations", endpoint="http://127.0.0.1:9")
    store = open_for(shared, tmp_path, Config(settings={"store": behind}), local=True)
    assert store.behind is None and noted_tokens(_launch(tmp_path), shared) == [3]
