"""The slot-file reader: header, tokens, every KV section checked against the file size."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hooks.kvfile.format import SlotFileError, read
from tests.slotfiles import slot_bytes


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


@pytest.mark.parametrize("share", [0.2, 0.35, 0.5, 0.65, 0.8, 0.95, 0.99])
def test_a_file_cut_anywhere_is_refused(tmp_path: Path, share: float) -> None:
    """Gemma's first section holds only its few global layers: a file cut inside the SWA section after it once
    passed the check, and the restore made llama-server abort (GGML_ASSERT(nread <= state_size))."""
    data = slot_bytes(list(range(40)), n_layer=3, cells=40, row=64, swa=(15, 40))
    whole = tmp_path / "whole.bin"
    whole.write_bytes(data)
    assert read(whole).kv is not None
    cut = tmp_path / "cut.bin"
    cut.write_bytes(data[:int(len(data) * share)])
    with pytest.raises(SlotFileError, match=r"truncated|does not fit|does not parse"):
        read(cut)


def test_every_section_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "swa.bin"
    path.write_bytes(slot_bytes([1, 2, 3], swa=(4, 3)))
    assert read(path).summary()["sections"] == 2


def test_bytes_after_the_last_section_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "long.bin"
    path.write_bytes(slot_bytes([1, 2, 3]) + b"\0\0\0")
    with pytest.raises(SlotFileError):
        read(path)
