"""The llama.cpp sequence-state file a slot save writes: header, tokens and the KV layout, no server needed.

Layout (little-endian, as every host llama.cpp runs on writes it): u32 magic 'ggsq', u32 version, u32 n_words,
i32 words[n_words]; the words are either plain tokens (older servers) or the server's token state
(-1, u32 1, u32 n, tokens, u32 n_media, ...).
Then one KV section per cache (two for sliding-window models: the global one, then the SWA one): u32 n_stream,
per stream u32 cell_count and, when cells, their metadata (i32 pos, u32 n_seq_id, [12 bytes of M-RoPE
positions and token; 8 before state version 3], i32 seq_id x n_seq_id), u32 v_trans, u32 n_layer, u32 n_rot_k,
u32 n_rot_v (from state version 4: before, the rotation is implied by the cache type), per layer K
(i32 type, u64 row size, rows), per layer V (the same, or i32 type, u32 element size, u32 n_embd_v and the
transposed data).

`walk` is the one reader of that layout: `read` (summary and validation), `kvconvert` (rewriting the rows) and
the state-version probe all use it. Every span is checked against the file size before anyone relies on it.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC = 0x67677371  # 'ggsq'
GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16",
              39: "mxfp4", 41: "iq4_nl"}
_CELL_EXT_CHOICES = (0, 12)  # M-RoPE models store 12 more bytes per cell; the file does not say which
_CELL_EXT_BEFORE_3 = (0, 8)  # before state version 3: the M-RoPE positions only
READS = (2, 4)  # the state versions whose KV layout this reader walks (llama.cpp b9095 writes 2, b11434 4); a
# version 3 (between them) is read for its tokens only: its layout is not known from a build of it
ROT_WRITTEN = 4  # from this state version on, each stream says its K/V rotation (n_rot_k, n_rot_v)
MAX_STREAMS = 4096
MAX_LAYERS = 1024

Buffer = bytes | mmap.mmap | memoryview


class SlotFileError(Exception):
    """Not a slot file this reader understands, or a damaged one."""


@dataclass(frozen=True)
class Layer:
    """One layer's K or V rows: `cells` rows of `row_size` bytes from `start` (transposed V: element size x
    n_embd_v per cell, stored column by column)."""

    type_id: int
    row_size: int
    start: int
    header: int  # where its type record begins
    transposed: bool = False

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, str(self.type_id))


@dataclass(frozen=True)
class Stream:
    cells: int
    meta_start: int = 0
    meta_end: int = 0
    cell_ext: int = 0  # 12 for M-RoPE
    one_sequence: bool = True  # every cell belongs to one sequence (the slot case)
    v_trans: bool = False
    n_rot_k: int = 0
    n_rot_v: int = 0
    rot_written: bool = True  # False before state version 4: the rotation is the cache type's default
    k: tuple[Layer, ...] = ()
    v: tuple[Layer, ...] = ()


@dataclass(frozen=True)
class Section:
    start: int
    end: int
    streams: tuple[Stream, ...]


@dataclass(frozen=True)
class Header:
    version: int
    words_end: int  # where the tokens end and the KV sections begin
    token_format: str  # "server-state-1" or "plain"
    tokens: list[int]
    n_media: int


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
    sections: int = 1


@dataclass
class SlotFile:
    path: str
    bytes: int
    version: int
    token_format: str
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
            "sections": kv.sections if kv else None,
            "layers": kv.n_layer if kv else None, "v_transposed": kv.v_trans if kv else None,
            "rotation": {"k": kv.n_rot_k, "v": kv.n_rot_v} if kv and kv.n_layer is not None else None,
            "type_k": _one(kv.k_types) if kv else None, "type_v": _one(kv.v_types) if kv else None,
        }


def _one(types: list[str]) -> str | list[str] | None:
    if not types:
        return None
    return types[0] if len(set(types)) == 1 else types


class _Cursor:
    """Reads little-endian integers from a buffer, never past its end."""

    def __init__(self, data: Buffer, pos: int = 0) -> None:
        self.data, self.pos, self.size = data, pos, len(data)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise SlotFileError(f"truncated: {what} needs {n} bytes at byte {self.pos}, the file has {self.size}")

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        n = struct.calcsize(fmt)
        self.need(n, what)
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return tuple(int(v) for v in values)

    def u32(self, what: str) -> int:
        return self.unpack("<I", what)[0]

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n


def header(data: Buffer, name: str = "") -> Header:
    """Magic, version and the token words."""
    r = _Cursor(data)
    magic = r.u32("the magic") if r.size >= 4 else 0
    if magic != MAGIC:
        raise SlotFileError(f"{name}: not a llama.cpp slot file (magic {magic:#010x}); slot files are the "
                            "conv-<key>-<fingerprint>.bin (and older slotN-<fingerprint>.bin) files, not their "
                            ".json sidecars")
    version, n_words = r.unpack("<II", "the header")
    if n_words * 4 > r.size - r.pos:
        raise SlotFileError(f"{name}: token count {n_words} exceeds the file size")
    words = np.frombuffer(data, dtype="<i4", count=n_words, offset=r.pos)
    tokens, token_format, n_media = _tokens(words, name)
    return Header(version, r.pos + n_words * 4, token_format, tokens, n_media)


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


def walk(data: Buffer, start: int, version: int = ROT_WRITTEN) -> Iterator[Section]:
    """Every KV section from `start` to the end of the file, in the framing of state `version`, each span checked
    against the file size. SlotFileError when a section is cut short or does not parse."""
    if version not in READS:
        raise SlotFileError(f"state version {version}: this reader knows the KV layout of versions "
                            f"{', '.join(map(str, READS))}")
    r = _Cursor(data, start)
    while r.pos < r.size:
        yield _section(r, version)


def _section(r: _Cursor, version: int) -> Section:
    begin = r.pos
    n_stream = r.u32("a section's stream count")
    if not 0 < n_stream <= MAX_STREAMS:
        raise SlotFileError(f"implausible KV stream count {n_stream} at byte {begin} (damaged, or a section "
                            "this reader does not know)")
    streams = []
    for _ in range(n_stream):
        cells = r.u32("a stream's cell count")
        if cells == 0:
            streams.append(Stream(0))
            continue
        if cells * 12 > r.size - r.pos:  # each cell takes 12 bytes at least: never trust a count blindly
            raise SlotFileError(f"KV cell count {cells} does not fit the {r.size}-byte file (truncated or damaged)")
        stream, problem, at = None, "", r.pos
        for ext in _CELL_EXT_CHOICES if version >= 3 else _CELL_EXT_BEFORE_3:
            r.pos = at
            try:
                stream = _stream(r, cells, ext, version)
                break
            except SlotFileError as exc:
                problem = problem or str(exc)
        if stream is None:
            raise SlotFileError(f"the KV section at byte {begin} does not parse: {problem}")
        streams.append(stream)
    return Section(begin, r.pos, tuple(streams))


def _stream(r: _Cursor, cells: int, ext: int, version: int) -> Stream:
    meta_start = r.pos
    one_sequence = _cells(r, cells, ext)
    meta_end = r.pos
    rot_written = version >= ROT_WRITTEN
    if rot_written:
        v_trans, n_layer, n_rot_k, n_rot_v = r.unpack("<IIII", "the layer header")
    else:
        (v_trans, n_layer), n_rot_k, n_rot_v = r.unpack("<II", "the layer header"), 0, 0
    if v_trans > 1 or not 0 < n_layer <= MAX_LAYERS:
        raise SlotFileError(f"implausible layer header (v_trans {v_trans}, {n_layer} layers)")
    k = []
    for index in range(n_layer):
        at = r.pos
        type_id, row = r.unpack("<iQ", f"K layer {index}")
        if not 0 <= type_id < 64:
            raise SlotFileError(f"K layer {index}: unknown type {type_id}")
        k.append(Layer(type_id, row, r.pos, at))
        r.skip(row * cells, f"K layer {index}'s {cells} rows")
    v = []
    for index in range(n_layer):
        at = r.pos
        if v_trans:
            type_id, element, n_embd_v = r.unpack("<iII", f"V layer {index}")
            row, transposed = element * n_embd_v, True
        else:
            type_id, row = r.unpack("<iQ", f"V layer {index}")
            transposed = False
        if not 0 <= type_id < 64:
            raise SlotFileError(f"V layer {index}: unknown type {type_id}")
        v.append(Layer(type_id, row, r.pos, at, transposed))
        r.skip(row * cells, f"V layer {index}'s {cells} rows")
    return Stream(cells, meta_start, meta_end, ext, one_sequence, bool(v_trans), n_rot_k, n_rot_v, rot_written,
                  tuple(k), tuple(v))


def _cells(r: _Cursor, cells: int, ext: int) -> bool:
    """Step over the per-cell metadata; True when every cell has one sequence (read in one block then)."""
    record = 12 + ext  # i32 pos, u32 n_seq_id, [ext], i32 seq_id
    if cells * record <= r.size - r.pos:
        block = np.frombuffer(r.data, dtype="<u4", count=cells * record // 4, offset=r.pos)
        if bool((block.reshape(cells, record // 4)[:, 1] == 1).all()):
            r.pos += cells * record
            return True
    for _ in range(cells):
        r.skip(4, "a cell's position")
        n_seq = r.u32("a cell's sequence count")
        if n_seq > MAX_STREAMS:
            raise SlotFileError(f"implausible sequence count {n_seq} in a cell")
        r.skip(ext + 4 * n_seq, "a cell's sequences")
    return False


def open_map(path: str | os.PathLike[str]) -> tuple[Buffer, int]:
    """The file mapped read-only (b"" when empty) and its size."""
    name = os.fspath(path)
    with open(name, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return b"", 0
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ), size


def version(path: str | os.PathLike[str]) -> int:
    """The state version a file was written with (the probe a server writes tells what it reads)."""
    with open(path, "rb") as handle:
        head = handle.read(8)
    if len(head) < 8:
        raise SlotFileError(f"{os.fspath(path)}: truncated header")
    return int.from_bytes(head[4:8], "little")


def read(path: str | os.PathLike[str]) -> SlotFile:
    """Parse a slot file's header and tokens and walk every KV section (skipping the tensor data): a file cut
    short anywhere, or whose counts do not add up to its size, is a SlotFileError."""
    name = os.fspath(path)
    try:
        data, size = open_map(name)
    except OSError as exc:
        raise SlotFileError(f"cannot read {name}: {exc.strerror}") from exc
    try:
        head = header(data, name)
        kv = None
        if head.version in READS:
            try:
                kv = _layout(list(walk(data, head.words_end, head.version)))
            except SlotFileError:
                if head.version >= ROT_WRITTEN:
                    raise
                # an older build's layout this reader does not walk (recurrent memory, ...): its tokens still count
        return SlotFile(name, size, head.version, head.token_format, head.tokens, head.n_media, kv)
    except (struct.error, MemoryError, ValueError) as exc:  # whatever a damaged file makes of the reader
        raise SlotFileError(f"{name}: damaged: {exc!r}") from exc
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _layout(sections: list[Section]) -> KvLayout:
    """The summary: stream cell counts of the first section, the layer layout of its first stream with cells."""
    if not sections:
        raise SlotFileError("no KV section after the tokens (truncated)")
    first = sections[0]
    layout = KvLayout(n_stream=len(first.streams), cells=[s.cells for s in first.streams], sections=len(sections))
    stream = next((s for s in first.streams if s.cells), None)
    if stream is not None:
        layout.v_trans, layout.n_layer = stream.v_trans, len(stream.k)
        layout.n_rot_k, layout.n_rot_v = stream.n_rot_k, stream.n_rot_v
        layout.k_types = [layer.type_name for layer in stream.k]
        layout.v_types = [layer.type_name for layer in stream.v]
    return layout
