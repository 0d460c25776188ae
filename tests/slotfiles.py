"""Slot files for tests: the documented byte layout, and pairs committed the way slots.save commits them."""

from __future__ import annotations

import struct
from pathlib import Path

from hooks.kvfile.format import MAGIC
from hooks.store import layout


def slot_bytes(tokens: list[int], n_layer: int = 2, cells: int = 3, row: int = 8, k_type: int = 1,
               v_trans: int = 0, server_state: bool = True, version: int = 4,
               swa: tuple[int, int] | None = None) -> bytes:
    """A slot file in the documented layout (one stream, one sequence); `swa` (layers, cells): a second KV
    section, as sliding-window models write it after the global one."""
    words = [-1, 1, len(tokens), *tokens, 0] if server_state else tokens
    out = struct.pack("<III", MAGIC, version, len(words)) + struct.pack(f"<{len(words)}i", *words)
    out += _section(n_layer, cells, row, k_type, v_trans, version)
    if swa is not None:
        out += _section(swa[0], swa[1], row, k_type, v_trans, version)
    return out


def _section(n_layer: int, cells: int, row: int, k_type: int, v_trans: int, version: int) -> bytes:
    out = struct.pack("<II", 1, cells)
    for pos in range(cells):
        out += struct.pack("<iIi", pos, 1, 0)
    out += struct.pack("<IIII", v_trans, n_layer, 0, 0) if version >= 4 else struct.pack("<II", v_trans, n_layer)
    for _ in range(n_layer):
        out += struct.pack("<iQ", k_type, row) + b"\0" * row * cells
    for _ in range(n_layer):
        if v_trans:
            out += struct.pack("<iII", k_type, 2, row // 2) + b"\0" * row * cells
        else:
            out += struct.pack("<iQ", k_type, row) + b"\0" * row * cells
    return out


def make_pair(folder: Path, model_id: str, slot: int, tokens: list[int]) -> Path:
    """A committed slot: its KV file and the sidecar that names it; returns the KV file."""
    folder.mkdir(parents=True, exist_ok=True)
    written = folder / f"slot{slot}.bin.0.tmp"
    written.write_bytes(slot_bytes(tokens))
    record = {"model": {"id": model_id, "name": "chat", "path": "/m/chat.gguf"}, "tokens": len(tokens),
              "cache_type_k": "f16", "cache_type_v": "f16", "saved_at": "2026-11-29T12:00:00+00:00",
              "build": "b11434"}
    return layout.commit(folder, slot, written, record)
