"""`llama-wrapper slots ls|inspect|rm` over a slot folder, no server."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from click.testing import CliRunner

from hooks.store import layout
from hooks.store.folder import DirectoryStore, part_name
from tests.slotfiles import kv_state, make_pair, slot_bytes
from wrapper.cli.main import main


def test_ls_inspect_rm(tmp_path: Path) -> None:
    first = make_pair(tmp_path / "aaaa", "aaaa", 0, [1, 2, 3])
    second = make_pair(tmp_path / "aaaa", "aaaa", 1, [4, 5])
    make_pair(tmp_path / "bbbb", "bbbb", 0, [6])
    runner = CliRunner()

    listed = runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(r["model_id"], r["slot"], r["tokens"]) for r in rows] == [("aaaa", 0, 3), ("aaaa", 1, 2), ("bbbb", 0, 1)]
    assert not any("problem" in r for r in rows)
    table = runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path)])
    assert "chat" in table.output and "f16/f16" in table.output
    assert first.name in table.output and second.name in table.output  # what `slots inspect` needs

    inspected = runner.invoke(main, ["slots", "inspect", str(first)])
    summary = json.loads(inspected.output)
    assert (summary["tokens"], summary["layers"], summary["type_k"]) == (3, 2, "f16")
    assert summary["sidecar"]["model"]["name"] == "chat" and summary["sidecar"]["file"] == first.name

    removed = runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "aaaa", "--slot", "1"])
    assert removed.exit_code == 0 and second.name in removed.output and "slot1.json" in removed.output
    assert sorted(p.name for p in (tmp_path / "aaaa").iterdir()) == sorted(["slot0.json", first.name])
    assert runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "nope"]).exit_code == 1
    assert runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), ".."]).exit_code == 1
    by_name = runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "chat"])  # the model's name, not its id
    assert by_name.exit_code == 1 and "model ids: aaaa (chat), bbbb (chat)" in by_name.output, by_name.output


def test_ls_names_a_pair_that_does_not_match(tmp_path: Path) -> None:
    kv_file = make_pair(tmp_path / "aaaa", "aaaa", 0, [1, 2, 3])
    kv_file.write_bytes(kv_file.read_bytes() + b"more")
    rows = [json.loads(line) for line in
            CliRunner().invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"]).output.splitlines()]
    assert "an interrupted save?" in rows[0]["problem"]


def test_inspect_a_damaged_file(tmp_path: Path) -> None:
    bad = tmp_path / "slot0.bin"
    bad.write_bytes(b"nonsense")
    result = CliRunner().invoke(main, ["slots", "inspect", str(bad)])
    assert result.exit_code == 1 and "not a llama.cpp slot file" in result.output


def test_inspect_a_file_whose_cell_count_is_absurd(tmp_path: Path) -> None:
    """0xFFFFFFFF cells once made the reader allocate 51 GB and print a traceback."""
    data = bytearray(slot_bytes([1, 2, 3]))
    cells_at = 12 + 4 * 7 + 4  # header, 7 token words, the stream count
    assert struct.unpack_from("<I", data, cells_at)[0] == 3
    struct.pack_into("<I", data, cells_at, 0xFFFFFFFF)
    bad = tmp_path / "slot0.bin"
    bad.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["slots", "inspect", str(bad)])
    assert result.exit_code == 1 and "KV cell count 4294967295 does not fit" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_messages_say_what_is_wrong_and_what_to_do(tmp_path: Path) -> None:
    make_pair(tmp_path / "aaaa", "aaaa", 0, [1, 2, 3])
    runner = CliRunner()
    removed = runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "aaaa", "--slot", "4"])
    assert removed.exit_code == 1 and "model aaaa has no saved slot 4" in removed.output
    inspected = runner.invoke(main, ["slots", "inspect", str(tmp_path / "aaaa" / "slot0.json")])
    assert inspected.exit_code == 1 and "not their .json sidecars" in inspected.output


def test_ls_and_inspect_name_an_entry_that_is_not_what_its_sidecar_says(tmp_path: Path) -> None:
    folder = tmp_path / "aaaa"
    folder.mkdir()
    store = DirectoryStore(folder, chunk_tokens=16)
    entries = []
    for start in (1000, 2000, 3000):
        tokens = list(range(start, start + 70))
        part = folder / part_name("test")
        part.write_bytes(kv_state(tokens))
        entries.append(store.commit(part, tokens, {"model": {"id": "aaaa", "name": "chat"},
                                                   "cache_type_k": "f16", "cache_type_v": "f16"}))
    sound, changed, cut = entries
    tail = folder / changed.name
    data = bytearray(tail.read_bytes())
    data[-1] ^= 0xFF  # the same size, other bytes: only the fingerprint tells
    tail.write_bytes(bytes(data))
    (folder / "chunks" / f"{cut.record['chunks']['names'][2]}.kv").unlink()
    runner = CliRunner()
    rows = {row["entry"]: row for row in (json.loads(line) for line in
            runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"]).output.splitlines())}
    assert "problem" not in rows[sound.key]
    assert "fingerprint differs" in rows[changed.key]["problem"]
    assert "1 of its 4 chunks missing or cut" in rows[cut.key]["problem"]
    table = runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path)]).output
    assert "fingerprint differs" in table
    inspected = json.loads(runner.invoke(main, ["slots", "inspect", str(folder / cut.name)]).output)
    assert "chunks missing" in inspected["problem"]
    assert "problem" not in json.loads(runner.invoke(main, ["slots", "inspect", str(folder / sound.name)]).output)


def test_ls_names_a_noted_slot_whose_sidecar_cannot_be_used(tmp_path: Path) -> None:
    folder = tmp_path / "aaaa"
    folder.mkdir()
    store = DirectoryStore(folder)
    part = folder / part_name("test")
    part.write_bytes(slot_bytes([1, 2, 3]))
    entry = store.commit(part, [1, 2, 3], {"model": {"id": "aaaa", "name": "chat"}})
    store.note(layout.host_id(), {0: entry})
    sidecar = folder / f"conv-{entry.key}.json"
    sidecar.write_text(sidecar.read_text().replace(entry.name, "../outside.bin"))
    (row,) = [json.loads(line) for line in
              CliRunner().invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"]).output.splitlines()]
    assert row["slot"] == 0 and row["tokens"] == 3 and "names an odd file: '../outside.bin'" in row["problem"]


def test_ls_names_a_noted_slot_whose_sidecar_is_gone_and_inspect_an_orphan_tail(tmp_path: Path) -> None:
    folder = tmp_path / "aaaa"
    folder.mkdir()
    store = DirectoryStore(folder)
    part = folder / part_name("test")
    part.write_bytes(slot_bytes([1, 2, 3]))
    entry = store.commit(part, [1, 2, 3], {"model": {"id": "aaaa", "name": "chat"}})
    store.note(layout.host_id(), {1: entry})
    (folder / f"conv-{entry.key}.json").unlink()
    runner = CliRunner()
    (row,) = [json.loads(line) for line in
              runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"]).output.splitlines()]
    assert (row["slot"], row["tokens"], row["where"]) == (1, 3, "gone") and "no sidecar" in row["problem"]
    inspected = json.loads(runner.invoke(main, ["slots", "inspect", str(folder / entry.name)]).output)
    assert "no sidecar names this file" in inspected["problem"]


def test_inspect_folds_long_lists_and_stays_json() -> None:
    from hooks.slots.cli import folded

    summary = {"tokens": 3, "sidecar": {"chunks": {"count": 200, "names": [f"{i:032x}" for i in range(200)]}},
               "nested": [{"a": [1, 2]}, []], "empty": {}}
    text = folded(summary)
    assert json.loads(text) == summary
    assert 2 * len(text.splitlines()) < len(json.dumps(summary, indent=2).splitlines())
    assert max(len(line) for line in text.splitlines()) <= 116
