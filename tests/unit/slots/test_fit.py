"""Fitting the child's argv for slot persistence, from what the binary's --help offers."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.slots.fit import fit_for_slots
from hooks.slots.settings import SlotSettings
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, Listen
from wrapper.configuration.consumers import ConsumerSettings
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model


def fake_server(tmp_path: Path, flags: str) -> str:
    """A real executable whose --help lists `flags` (the way a user's own build answers)."""
    path = tmp_path / "my-llama-server"
    path.write_text(f"#!/bin/sh\necho 'usage: llama-server [options]'\necho '{flags}'\n")
    path.chmod(0o755)
    return str(path)


def _config(tmp_path: Path) -> Config:
    return Config(settings={"slots": SlotSettings(dir=tmp_path / "s", swa_full="always")})


def _launch(argv: list[str]) -> Launch:
    return Launch(argv=argv, port=1, listen=Listen("127.0.0.1", 2), model=Model(None, "m", "id1"), env={})


def test_fitting_adds_what_persistence_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_server(tmp_path, "--slot-save-path PATH  -kvu, --kv-unified  --no-cache-idle-slots  --swa-full")
    argv = [binary, "-c", "0", "--slot-save-path", "/elsewhere"]
    fit = fit_for_slots(argv, _launch(argv), _config(tmp_path), Kept())
    assert args.get(fit.argv, args.SLOT_SAVE_PATH) == str(tmp_path / "s" / "id1") and fit.fitted.is_dir()
    assert args.has(fit.argv, args.KV_UNIFIED) and args.has(fit.argv, args.NO_CACHE_IDLE_SLOTS)
    assert args.has(fit.argv, args.SWA_FULL) and args.get(fit.argv, args.CTX_SIZE) == "4096"
    changes = " ".join(n["change"] for n in fit.notes)
    assert "(was /elsewhere)" in changes and "LOST" not in changes


def test_fitting_says_what_an_older_build_loses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_server(tmp_path, "--slot-save-path PATH  -cram, --cache-ram N")
    argv = [binary, "-c", "2048"]
    fit = fit_for_slots(argv, _launch(argv), _config(tmp_path), Kept())
    assert args.get(fit.argv, args.CTX_SIZE) == "2048" and args.get(fit.argv, args.CACHE_RAM) == "0"
    assert not args.has(fit.argv, args.SWA_FULL) and not args.has(fit.argv, args.KV_UNIFIED)
    assert any(n["change"].startswith("LOST: --swa-full") for n in fit.notes)


def test_isolated_consumers_turn_the_ram_prompt_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """llama-server's RAM prompt cache would give a slot any consumer's earlier prompt."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_server(tmp_path, "--slot-save-path PATH  --no-cache-idle-slots  -cram, --cache-ram N")
    argv = [binary, "-c", "2048", "-cram", "4096"]
    config = Config(settings={"slots": SlotSettings(dir=tmp_path / "s"),
                              "consumers": ConsumerSettings(keys=(("a", ("k1",)), ("b", ("k2",))))})
    fit = fit_for_slots(argv, _launch(argv), config, Kept())
    assert args.get(fit.argv, args.CACHE_RAM) == "0"
    assert any("consumers.isolate" in n["why"] for n in fit.notes)
    alone = fit_for_slots(argv, _launch(argv), _config(tmp_path), Kept())
    assert args.get(alone.argv, args.CACHE_RAM) == "4096"
