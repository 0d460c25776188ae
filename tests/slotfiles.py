"""Slot files for tests: the documented byte layout, and pairs committed the way slots.save commits them."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

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


MAX_POSITIONS = 4096


def kv_state(tokens: list[int], n_layer: int = 3, row: int = 16, k_type: int = 1, v_trans: bool = False,
          version: int = 4, cell_ext: int = 0, order: list[int] | None = None,
          swa: tuple[int, int] | None = None, seed: int = 0, media: int = 0, streams: int = 1) -> bytes:
    """A state file in llama.cpp's layout with random KV, the same for a position in every state (as a model's
    is for the same tokens): one cell per token (in `order`, else position order);
    `swa` (first position, layers): a second section holding the cells from that position on; `streams`: the
    sequence in the last of that many streams (the others empty, as without a unified cache)."""
    words = [-1, 1, len(tokens), *tokens, media]
    out = struct.pack("<III", MAGIC, version, len(words)) + struct.pack(f"<{len(words)}i", *words)
    positions = order if order is not None else list(range(len(tokens)))
    out += _kv_section(positions, n_layer, row, k_type, v_trans, version, cell_ext, seed, streams)
    if swa is not None:
        out += _kv_section([p for p in positions if p >= swa[0]], swa[1], row, k_type, v_trans, version, cell_ext,
                        seed + 1, streams)
    return out


def _kv_section(positions: list[int], n_layer: int, row: int, k_type: int, v_trans: bool, version: int,
             cell_ext: int, seed: int, streams: int) -> bytes:
    cells = len(positions)

    def values(what: int, width: int) -> np.ndarray[Any, np.dtype[np.uint8]]:  # per position, whatever the state
        table = np.random.default_rng([seed, what]).integers(0, 255, (MAX_POSITIONS, width), dtype=np.uint8)
        return table[positions]

    out = struct.pack("<I", streams) + struct.pack("<I", 0) * (streams - 1) + struct.pack("<I", cells)
    ext = values(0, cell_ext)
    for index, pos in enumerate(positions):
        out += struct.pack("<iI", pos, 1) + ext[index].tobytes() + struct.pack("<i", 0)
    out += struct.pack("<IIII", int(v_trans), n_layer, 64 if k_type == 8 else 0, 0) if version >= 4 \
        else struct.pack("<II", int(v_trans), n_layer)
    for layer in range(n_layer):
        out += struct.pack("<iQ", k_type, row) + values(1 + layer, row).tobytes()
    for layer in range(n_layer):
        rows = values(1000 + layer, row)
        if v_trans:  # each of its row // 2 rows holds one 2-byte element of every cell
            out += struct.pack("<iII", k_type, 2, row // 2)
            out += rows.reshape(cells, row // 2, 2).transpose(1, 0, 2).tobytes()
        else:
            out += struct.pack("<iQ", k_type, row) + rows.tobytes()
    return out
