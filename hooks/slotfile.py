"""The llama.cpp sequence-state file a slot save writes: header, tokens and the KV layout, no server needed.

Layout (little-endian, as every host llama.cpp runs on writes it): u32 magic 'ggsq', u32 version, u32 n_words,
i32 words[n_words]; the words are either plain tokens (older servers) or the server's token state
(-1, u32 1, u32 n, tokens, u32 n_media, ...).
Then the KV cache: u32 n_stream, per stream u32 cell_count and, when cells, their metadata and data.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

MAGIC = 0x67677371  # 'ggsq'
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16",
              39: "mxfp4", 41: "iq4_nl"}
_CELL_EXT_CHOICES = (0, 12)  # M-RoPE models store 12 more bytes per cell; the file does not say which


class SlotFileError(Exception):
    """Not a slot file this reader understands, or a damaged one."""


@dataclass
class KvLayout:
    n_stream: int
    cells: list[int]
    v_trans: bool | None = None
    n_layer: int | None = None
    n_rot_k: int | None = None
    n_rot_v: int | None = None
    k_types: list[str] = field(default_factory=list)
    v_types: list[str] = field(default_factory=list)


@dataclass
class SlotFile:
    path: str
    bytes: int
    version: int
    token_format: str  # "server-state-1" or "plain"
    tokens: list[int]
    n_media: int
    kv: KvLayout | None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def summary(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "path": self.path, "bytes": self.bytes, "state_version": self.version,
            "token_format": self.token_format, "tokens": self.n_tokens, "media": self.n_media,
            "streams": kv.n_stream if kv else None, "cells": kv.cells if kv else None,
            "layers": kv.n_layer if kv else None, "v_transposed": kv.v_trans if kv else None,
            "rotation": {"k": kv.n_rot_k, "v": kv.n_rot_v} if kv and kv.n_layer is not None else None,
            "type_k": _one(kv.k_types) if kv else None, "type_v": _one(kv.v_types) if kv else None,
        }


def _one(types: list[str]) -> str | list[str] | None:
    if not types:
        return None
    return types[0] if len(set(types)) == 1 else types


class _Reader:
    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle, self.size = handle, size

    def u32(self) -> int:
        return int(struct.unpack("<I", self.exact(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.exact(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.exact(8))[0])

    def exact(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise SlotFileError(f"truncated at byte {self.handle.tell()} (wanted {n} more)")
        return data

    def remaining(self) -> int:
        return self.size - self.handle.tell()

    def skip(self, n: int) -> None:
        if self.handle.tell() + n > self.size:
            raise SlotFileError(f"truncated: {n} bytes of data expected at byte {self.handle.tell()}")
        self.handle.seek(n, os.SEEK_CUR)


def read(path: str | os.PathLike[str]) -> SlotFile:
    """Parse a slot file's header, tokens and KV layout (skipping the tensor data)."""
    name = os.fspath(path)
    try:
        size = os.path.getsize(name)
        with open(name, "rb") as handle:
            return _parse(_Reader(handle, size), name, size)
    except OSError as exc:
        raise SlotFileError(f"cannot read {name}: {exc.strerror}") from exc
    except (struct.error, MemoryError, ValueError) as exc:  # whatever a damaged file makes of the reader
        raise SlotFileError(f"{name}: damaged: {exc!r}") from exc


def _parse(r: _Reader, name: str, size: int) -> SlotFile:
    magic, version = r.u32(), r.u32()
    if magic != MAGIC:
        raise SlotFileError(f"{name}: not a llama.cpp slot file (magic {magic:#010x})")
    n_words = r.u32()
    if n_words * 4 > r.remaining():
        raise SlotFileError(f"{name}: token count {n_words} exceeds the file size")
    words = np.frombuffer(r.exact(n_words * 4), dtype="<i4")
    tokens, token_format, n_media = _tokens(words, name)
    kv = _kv_layout(r) if version >= 3 else None
    return SlotFile(name, size, version, token_format, tokens, n_media, kv)


def _tokens(words: np.ndarray[Any, np.dtype[np.int32]], name: str) -> tuple[list[int], str, int]:
    if len(words) == 0 or words[0] != -1:
        return words.tolist(), "plain", 0
    if len(words) < 3:
        raise SlotFileError(f"{name}: token state too short")
    state_version, n_tokens = int(words[1]), int(words[2])
    if 3 + n_tokens > len(words):
        raise SlotFileError(f"{name}: token state says {n_tokens} tokens but holds {len(words) - 3}")
    n_media = int(words[3 + n_tokens]) if 3 + n_tokens < len(words) else 0
    return words[3:3 + n_tokens].tolist(), f"server-state-{state_version}", n_media


def _kv_layout(r: _Reader) -> KvLayout:
    n_stream = r.u32()
    if not 0 < n_stream <= 4096:
        raise SlotFileError(f"implausible KV stream count {n_stream}")
    layout = KvLayout(n_stream=n_stream, cells=[])
    for _ in range(n_stream):
        cell_count = r.u32()
        layout.cells.append(cell_count)
        if cell_count == 0:
            continue
        if layout.n_layer is not None:  # the first stream with cells tells the layout; stop there
            break
        if cell_count * 12 > r.remaining():  # each cell takes 12 bytes at least: never trust a count blindly
            raise SlotFileError(f"KV cell count {cell_count} does not fit the {r.size}-byte file (damaged)")
        start = r.handle.tell()
        for ext in _CELL_EXT_CHOICES:
            r.handle.seek(start)
            if _cells_and_layers(r, cell_count, ext, layout):
                break
        else:
            raise SlotFileError("the KV section does not parse (damaged, or a layout this reader does not know)")
        break
    return layout


def _skip_cells(r: _Reader, cell_count: int, ext: int) -> bool:
    """Step over the per-cell metadata: in one read when every cell has one sequence (the slot case)."""
    record = 12 + ext  # i32 pos, u32 n_seq_id, [ext], i32 seq_id
    start = r.handle.tell()
    if cell_count * record > r.remaining():
        return False
    block = r.handle.read(cell_count * record)
    if len(block) == cell_count * record:
        cells = np.frombuffer(block, dtype="<u4").reshape(cell_count, record // 4)
        if bool((cells[:, 1] == 1).all()):
            return True
    r.handle.seek(start)
    for _ in range(cell_count):
        r.skip(4)  # pos
        n_seq = r.u32()
        if n_seq > 4096:
            return False
        r.skip(ext + 4 * n_seq)
    return True


def _cells_and_layers(r: _Reader, cell_count: int, ext: int, layout: KvLayout) -> bool:
    try:
        if not _skip_cells(r, cell_count, ext):
            return False
        v_trans, n_layer, n_rot_k, n_rot_v = r.u32(), r.u32(), r.u32(), r.u32()
        if v_trans > 1 or not 0 < n_layer <= 1024:
            return False
        k_types = []
        for _ in range(n_layer):
            k_type, row = r.i32(), r.u64()
            if k_type not in GGML_TYPES and not 0 <= k_type < 64:
                return False
            r.skip(row * cell_count)
            k_types.append(GGML_TYPES.get(k_type, str(k_type)))
        v_types = []
        for _ in range(n_layer):
            v_type = r.i32()
            if v_trans:
                elem, n_embd_v = r.u32(), r.u32()
                r.skip(elem * n_embd_v * cell_count)
            else:
                r.skip(r.u64() * cell_count)
            v_types.append(GGML_TYPES.get(v_type, str(v_type)))
    except SlotFileError:
        return False
    layout.v_trans, layout.n_layer = bool(v_trans), n_layer
    layout.n_rot_k, layout.n_rot_v = n_rot_k, n_rot_v
    layout.k_types, layout.v_types = k_types, v_types
    return True
