"""`llama-wrapper slots ls|inspect|rm` over a slot folder, no server."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from click.testing import CliRunner

from tests.slotfiles import make_pair, slot_bytes
from wrapper.cli import main


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
