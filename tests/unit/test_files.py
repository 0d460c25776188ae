"""Reading slot files and GGUF headers; learning flags from --help; fitting the argv for persistence."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from hooks.fitting import fit_for_slots
from hooks.slotfile import SlotFileError, read
from tests.slotfiles import slot_bytes
from wrapper import argv as args
from wrapper.config import Config, Listen
from wrapper.gguf_meta import architecture_facts, read_metadata
from wrapper.launch import Launch
from wrapper.model import Model, fingerprint


@pytest.mark.parametrize("v_trans", [0, 1])
def test_slot_file_header(tmp_path: Path, v_trans: int) -> None:
    path = tmp_path / "slot0.bin"
    path.write_bytes(slot_bytes([5, 6, 7], k_type=8, v_trans=v_trans))
    parsed = read(path)
    summary = parsed.summary()
    assert parsed.tokens == [5, 6, 7] and parsed.token_format == "server-state-1"
    assert (summary["streams"], summary["cells"], summary["layers"]) == (1, [3], 2)
    assert (summary["type_k"], summary["type_v"], summary["v_transposed"]) == ("q8_0", "q8_0", bool(v_trans))


def test_plain_token_files_of_older_servers(tmp_path: Path) -> None:
    path = tmp_path / "slot0.bin"
    path.write_bytes(slot_bytes([1, 2], server_state=False))
    assert read(path).tokens == [1, 2] and read(path).token_format == "plain"


@pytest.mark.parametrize("damage", ["magic", "truncated", "tokens", "empty"])
def test_damaged_slot_files_are_errors(tmp_path: Path, damage: str) -> None:
    data = slot_bytes([1, 2, 3])
    if damage == "magic":
        data = b"XXXX" + data[4:]
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "tokens":
        data = data[:8] + struct.pack("<I", 10**8) + data[12:]
    else:
        data = b""
    path = tmp_path / "slot0.bin"
    path.write_bytes(data)
    with pytest.raises(SlotFileError):
        read(path)


def test_gguf_header_without_reading_arrays(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_context_length(32768)
    writer.add_block_count(4)
    writer.add_sliding_window(512)
    writer.add_token_list([f"tok{i}".encode() for i in range(5000)])
    writer.add_array("gemma3.attention.head_count_kv", [1, 1, 2, 2])
    writer.add_tensor("t", np.zeros((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_metadata(str(path))
    assert meta["gemma3.attention.head_count_kv"] == [1, 1, 2, 2]
    assert "tokenizer.ggml.tokens" not in meta
    assert architecture_facts(meta) == {"architecture": "gemma3", "context_length": 32768, "block_count": 4,
                                        "sliding_window": 512, "head_dim_k": None, "head_dim_v": None}


def test_fingerprint_tells_files_apart_at_either_end(tmp_path: Path) -> None:
    """The id of a model: the size, the first and the last MiB. Same bytes, same id; a change there, another."""
    body = bytearray(np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    ids = []
    for change in (None, 10, len(body) - 10, len(body) // 2):
        data = bytearray(body)
        if change is not None:
            data[change] ^= 0xFF
        path = tmp_path / f"m{change}.gguf"
        path.write_bytes(bytes(data))
        ids.append(fingerprint(str(path)))
    original, head, tail, middle = ids
    assert len(original) == 16 and int(original, 16) >= 0
    assert head != original and tail != original  # the metadata and the last tensor are sampled
    assert middle == original  # the middle is not read: that is what keeps it quick on 100 GB
    (tmp_path / "longer.gguf").write_bytes(bytes(body) + b"\0")
    assert fingerprint(str(tmp_path / "longer.gguf")) != original  # the size is part of it


def fake_server(tmp_path: Path, flags: str) -> str:
    """A real executable whose --help lists `flags` (the way a user's own build answers)."""
    path = tmp_path / "my-llama-server"
    path.write_text(f"#!/bin/sh\necho 'usage: llama-server [options]'\necho '{flags}'\n")
    path.chmod(0o755)
    return str(path)


def _launch(argv: list[str]) -> Launch:
    return Launch(argv=argv, port=1, listen=Listen("127.0.0.1", 2), model=Model(None, "m", "id1"), env={})


def test_fitting_adds_what_persistence_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_server(tmp_path, "--slot-save-path PATH  -kvu, --kv-unified  --no-cache-idle-slots  --swa-full")
    argv = [binary, "-c", "0", "--slot-save-path", "/elsewhere"]
    fit = fit_for_slots(argv, _launch(argv), Config(slots_dir=tmp_path / "s", swa_full="always"))
    assert args.get(fit.argv, args.SLOT_SAVE_PATH) == str(tmp_path / "s" / "id1") and fit.prepared.is_dir()
    assert args.has(fit.argv, args.KV_UNIFIED) and args.has(fit.argv, args.NO_CACHE_IDLE_SLOTS)
    assert args.has(fit.argv, args.SWA_FULL) and args.get(fit.argv, args.CTX_SIZE) == "4096"
    changes = " ".join(n["change"] for n in fit.notes)
    assert "(was /elsewhere)" in changes and "LOST" not in changes


def test_fitting_says_what_an_older_build_loses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    binary = fake_server(tmp_path, "--slot-save-path PATH  -cram, --cache-ram N")
    argv = [binary, "-c", "2048"]
    fit = fit_for_slots(argv, _launch(argv), Config(slots_dir=tmp_path / "s", swa_full="always"))
    assert args.get(fit.argv, args.CTX_SIZE) == "2048" and args.get(fit.argv, args.CACHE_RAM) == "0"
    assert not args.has(fit.argv, args.SWA_FULL) and not args.has(fit.argv, args.KV_UNIFIED)
    assert any(n["change"].startswith("LOST: --swa-full") for n in fit.notes)


def test_argv_helpers() -> None:
    argv = ["s", "--port=1", "-c", "10", "--host", "h", "-kvu", "-no-kvu"]
    assert args.get(argv, args.PORT) == "1" and args.get(argv, args.CTX_SIZE) == "10"
    assert args.remove(args.remove(argv, args.HOST), args.PORT) == ["s", "-c", "10", "-kvu", "-no-kvu"]
    assert args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) is False
    assert args.replace(argv, args.CTX_SIZE, "20")[-2:] == ["--ctx-size", "20"]
