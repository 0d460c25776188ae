"""`llama-wrapper slots ls|inspect|rm` over a slot folder, no server."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from tests.unit.test_files import slot_bytes
from wrapper.cli import main


def make_slot(root: Path, model_id: str, slot: int, tokens: list[int]) -> Path:
    folder = root / model_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"slot{slot}.bin"
    path.write_bytes(slot_bytes(tokens))
    sidecar = {"format": 1, "slot": slot, "model": {"id": model_id, "name": "chat", "path": "/m/chat.gguf"},
               "tokens": len(tokens), "bytes": path.stat().st_size, "cache_type_k": "f16", "cache_type_v": "f16",
               "saved_at": "2026-11-29T12:00:00+00:00", "build": "b11434"}
    (folder / f"slot{slot}.json").write_text(json.dumps(sidecar))
    return path


def test_ls_inspect_rm(tmp_path: Path) -> None:
    first = make_slot(tmp_path, "aaaa", 0, [1, 2, 3])
    make_slot(tmp_path, "aaaa", 1, [4, 5])
    make_slot(tmp_path, "bbbb", 0, [6])
    runner = CliRunner()

    listed = runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path), "--json"])
    assert listed.exit_code == 0
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(r["model_id"], r["slot"], r["tokens"]) for r in rows] == [("aaaa", 0, 3), ("aaaa", 1, 2), ("bbbb", 0, 1)]
    table = runner.invoke(main, ["slots", "ls", "--dir", str(tmp_path)])
    assert "chat" in table.output and "f16/f16" in table.output

    inspected = runner.invoke(main, ["slots", "inspect", str(first)])
    summary = json.loads(inspected.output)
    assert (summary["tokens"], summary["layers"], summary["type_k"]) == (3, 2, "f16")
    assert summary["sidecar"]["model"]["name"] == "chat"

    removed = runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "aaaa", "--slot", "1"])
    assert removed.exit_code == 0 and "slot1.bin" in removed.output
    assert sorted(p.name for p in (tmp_path / "aaaa").iterdir()) == ["slot0.bin", "slot0.json"]
    assert runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), "nope"]).exit_code == 1
    assert runner.invoke(main, ["slots", "rm", "--dir", str(tmp_path), ".."]).exit_code == 1


def test_inspect_a_damaged_file(tmp_path: Path) -> None:
    bad = tmp_path / "slot0.bin"
    bad.write_bytes(b"nonsense")
    result = CliRunner().invoke(main, ["slots", "inspect", str(bad)])
    assert result.exit_code == 1 and "not a llama.cpp slot file" in result.output
