"""Rates kept on this machine: written whole, read back, and what a killed writer left swept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wrapper.launching import measured


def test_a_file_is_written_whole_read_back_and_throttled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kept = measured.MeasuredFile("m1", every_s=60)
    kept.write({"prefill_tps": 10.0}, now=True)
    kept.write({"prefill_tps": 20.0})  # within every_s: not written
    assert measured.MeasuredFile("m1").read() == {"prefill_tps": 10.0}
    (tmp_path / "llama-wrapper" / "rates" / "m1.json").write_text("not json")
    assert measured.MeasuredFile("m1").read() == {}


def test_the_temporaries_of_dead_writers_are_swept(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    folder = tmp_path / "rates"
    folder.mkdir()
    (folder / f"m1.json.{dead}.tmp").write_text("")
    (folder / "m1.json.1.tmp").write_text("")  # pid 1 lives
    (folder / "m1.json").write_text("{}")
    assert measured.sweep(folder) == [f"m1.json.{dead}.tmp"]
    assert sorted(p.name for p in folder.iterdir()) == ["m1.json", "m1.json.1.tmp"]
