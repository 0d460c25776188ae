"""A saved state as chunks and a tail, so that a new turn writes only what it adds.

A chunk holds the KV of a run of `tokens` consecutive positions (0 to n, n to 2n, ...) of every stream that holds
the sequence from position 0 on, one cell per position: in each such stream its cells' metadata, every layer's
K rows and every layer's V rows (for a transposed V, each of its rows' elements of those cells). It is named by a
hash chained over the model, the streams' layout and the tokens up to its end: the KV of those positions depends
on nothing else, so a longer state of the same conversation, or another conversation with the same beginning,
names the same chunk and does not write it again.

The tail is a state file llama-server could read, holding what the chunks do not: the header and tokens, the
cells after the last whole chunk, and every stream that is not chunked as it was (a sliding-window section whose
cells no longer begin at 0, a state with media or with cells of several sequences). A state no stream of which
can be chunked is its tail alone: the layout the store wrote before chunks.

`split` and `assemble` are inverses: assembling the chunks into the tail gives back the state (its cells in
position order: llama-server restores a sequence's cells in any order).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from hooks import kvfile
from hooks.kvfile.format import Buffer, SlotFileError

FORMAT = 1


class NotAssembled(Exception):
    """Chunks and a tail that do not make a state (a chunk of another size, a tail of another layout)."""


@dataclass(frozen=True)
class Chunk:
    name: str
    size: int
    make: Callable[[], bytes]  # its content, cut from the state when asked (one chunk in memory at a time)


@dataclass(frozen=True)
class Split:
    tail: bytes  # b"" when nothing is chunked: the state is its own tail
    chunks: list[Chunk]  # in position order; valid while the state's buffer is
    plan: dict[str, Any] | None  # what the manifest keeps to assemble them (with the names); None: not chunked


def split(data: Buffer, tokens: int, salt: str) -> Split:
    """Cut a state file into chunks of `tokens` positions and its tail; `salt` (the model) goes into each name."""
    head = kvfile.header(data)
    whole = Split(b"", [], None)
    if head.version not in kvfile.READS or head.n_media or tokens <= 0:
        return whole
    try:
        sections = list(kvfile.walk(data, head.words_end, head.version))
    except SlotFileError:
        return whole
    chunked = _chunkable(data, sections)
    if not chunked:
        return whole
    cells = chunked[0][2].cells
    count = min(cells, len(head.tokens)) // tokens
    if count == 0:
        return whole
    specs = [_spec(i, s, stream, data) for i, s, stream in chunked]
    names = _names(salt, specs, head.tokens, tokens, count)
    plan = {"format": FORMAT, "tokens": tokens, "count": count, "streams": specs, "names": names}
    orders = {(i, s): _order(data, stream) for i, s, stream in chunked}
    def make(index: int) -> Callable[[], bytes]:
        cut = slice(index * tokens, (index + 1) * tokens)
        return lambda: b"".join(_fragment(data, stream, orders[(i, s)][cut]) for i, s, stream in chunked)

    size = chunk_size(plan)
    pieces = [Chunk(names[index], size, make(index)) for index in range(count)]
    tail = bytearray(data[:head.words_end])
    for i, section in enumerate(sections):
        tail += struct.pack("<I", len(section.streams))
        for s, stream in enumerate(section.streams):
            if (i, s) in orders:
                tail += _rest(data, stream, orders[(i, s)][count * tokens:])
            else:
                tail += data[_stream_start(stream):_stream_end(stream)] if stream.cells else struct.pack("<I", 0)
    return Split(bytes(tail), pieces, plan)


def names_for(salt: str, plan: dict[str, Any], tokens: list[int]) -> list[str]:
    """The names a plan's chunks have when they hold these tokens' KV (what `split` named them): a manifest whose
    names are not these names is not this conversation's state."""
    return _names(salt, plan["streams"], tokens, int(plan["tokens"]), int(plan["count"]))


def chunk_size(plan: dict[str, Any]) -> int:
    """The bytes of each of the plan's chunks."""
    return int(plan["tokens"]) * sum(_cell_bytes(spec) for spec in plan["streams"])


def assemble(tail: Buffer, chunks: Sequence[Buffer], plan: dict[str, Any], out: BinaryIO) -> int:
    """Write the state the chunks and the tail make to `out`; its size. NotAssembled when they do not fit."""
    if plan.get("format") != FORMAT or len(chunks) != int(plan["count"]):
        raise NotAssembled(f"{len(chunks)} chunks for a plan of {plan.get('count')} (format {plan.get('format')})")
    size = chunk_size(plan)
    for index, chunk in enumerate(chunks):
        if len(chunk) != size:
            raise NotAssembled(f"chunk {index + 1} of {len(chunks)} has {len(chunk)} bytes, not {size}: damaged")
    try:
        head = kvfile.header(tail)
        sections = list(kvfile.walk(tail, head.words_end, head.version))
    except SlotFileError as exc:
        raise NotAssembled(f"the tail: {exc}") from exc
    specs = {(int(spec["section"]), int(spec["stream"])): spec for spec in plan["streams"]}
    offsets = _offsets(plan)
    written = out.write(tail[:head.words_end])
    for i, section in enumerate(sections):
        written += out.write(struct.pack("<I", len(section.streams)))
        for s, stream in enumerate(section.streams):
            spec = specs.pop((i, s), None)
            if spec is None:
                written += out.write(tail[_stream_start(stream):_stream_end(stream)] if stream.cells
                                     else struct.pack("<I", 0))
            else:
                written += _assemble_stream(tail, stream, spec, chunks, offsets[(i, s)], int(plan["tokens"]), out)
    if specs:
        raise NotAssembled(f"the tail lacks the chunked stream(s) {sorted(specs)}")
    return written


# -- which streams, in what order -------------------------------------------------------------------------------


def _chunkable(data: Buffer, sections: list[kvfile.Section]) -> list[tuple[int, int, kvfile.Stream]]:
    """The streams holding one sequence from position 0, one cell per position, as many cells as the first."""
    found: list[tuple[int, int, kvfile.Stream]] = []
    for i, section in enumerate(sections):
        for s, stream in enumerate(section.streams):
            if not stream.cells or not stream.one_sequence or (found and stream.cells != found[0][2].cells):
                continue
            positions = np.sort(_positions(data, stream))
            if np.array_equal(positions, np.arange(stream.cells, dtype=positions.dtype)):
                found.append((i, s, stream))
    return found


def _record(stream: kvfile.Stream) -> int:
    return 12 + stream.cell_ext  # i32 pos, u32 n_seq_id, [ext], i32 seq_id


def _positions(data: Buffer, stream: kvfile.Stream) -> np.ndarray[Any, np.dtype[np.int32]]:
    block = np.frombuffer(data, dtype="<i4", count=stream.cells * _record(stream) // 4, offset=stream.meta_start)
    return np.asarray(block.reshape(stream.cells, -1)[:, 0], dtype=np.int32)


def _order(data: Buffer, stream: kvfile.Stream) -> np.ndarray[Any, np.dtype[np.intp]]:
    """The stream's cells in position order (llama-server writes them so after a fresh prefill)."""
    return np.argsort(_positions(data, stream), kind="stable")


def _spec(section: int, index: int, stream: kvfile.Stream, data: Buffer) -> dict[str, Any]:
    return {"section": section, "stream": index, "cell_ext": stream.cell_ext, "v_trans": stream.v_trans,
            "rot": [stream.n_rot_k, stream.n_rot_v], "rot_written": stream.rot_written,
            "k": [[layer.type_id, layer.row_size] for layer in stream.k],
            "v": [[layer.type_id, layer.row_size, *_transposed(data, layer)] for layer in stream.v]}


def _transposed(data: Buffer, layer: kvfile.Layer) -> list[int]:
    """A transposed V layer's element size and row count (from its header), [] otherwise."""
    return list(_v_header_of(data, layer)) if layer.transposed else []


def _names(salt: str, specs: list[dict[str, Any]], tokens: list[int], per: int, count: int) -> list[str]:
    """Each chunk's name: a hash chained over the salt, the layout and the tokens up to the chunk's end."""
    chain = hashlib.sha256(f"{salt}\n{json.dumps(specs, sort_keys=True)}".encode()).digest()
    words = np.asarray(tokens[:per * count], dtype="<i4")
    names = []
    for index in range(count):
        chain = hashlib.sha256(chain + words[index * per:(index + 1) * per].tobytes()).digest()
        names.append(chain.hex()[:32])
    return names


def _cell_bytes(spec: dict[str, Any]) -> int:
    return 12 + int(spec["cell_ext"]) + sum(int(k[1]) for k in spec["k"]) + sum(int(v[1]) for v in spec["v"])


def _offsets(plan: dict[str, Any]) -> dict[tuple[int, int], int]:
    """Where each chunked stream's part begins in a chunk."""
    at, found = 0, {}
    for spec in plan["streams"]:
        found[(int(spec["section"]), int(spec["stream"]))] = at
        at += int(plan["tokens"]) * _cell_bytes(spec)
    return found


# -- cutting ----------------------------------------------------------------------------------------------------


def _rows(data: Buffer, start: int, cells: int, row: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(data, dtype=np.uint8, count=cells * row, offset=start).reshape(cells, row)


def _columns(data: Buffer, layer: kvfile.Layer, cells: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A transposed V layer as (its rows, cells, element bytes)."""
    element, n_embd = _v_header_of(data, layer)
    return np.frombuffer(data, dtype=np.uint8, count=cells * layer.row_size, offset=layer.start).reshape(
        n_embd, cells, element)


def _v_header_of(data: Buffer, layer: kvfile.Layer) -> tuple[int, int]:
    _, element, n_embd = struct.unpack_from("<iII", data, layer.header)
    return int(element), int(n_embd)


def _take(rows: np.ndarray[Any, Any], picked: np.ndarray[Any, np.dtype[np.intp]], axis: int = 0) -> bytes:
    """The picked cells' rows (a plain slice when they are consecutive: no copy but the result)."""
    if len(picked) and int(picked[-1]) - int(picked[0]) == len(picked) - 1 and \
            bool((np.diff(picked) == 1).all()):
        cut = slice(int(picked[0]), int(picked[-1]) + 1)
        return (rows[cut] if axis == 0 else rows[:, cut]).tobytes()
    return np.take(rows, picked, axis=axis).tobytes()


def _fragment(data: Buffer, stream: kvfile.Stream, picked: np.ndarray[Any, np.dtype[np.intp]]) -> bytes:
    """The picked cells of a stream: metadata, every K layer's rows, every V layer's rows or columns."""
    parts = [_take(_rows(data, stream.meta_start, stream.cells, _record(stream)), picked)]
    for layer in stream.k:
        parts.append(_take(_rows(data, layer.start, stream.cells, layer.row_size), picked))
    for layer in stream.v:
        if layer.transposed:
            parts.append(_take(_columns(data, layer, stream.cells), picked, axis=1))
        else:
            parts.append(_take(_rows(data, layer.start, stream.cells, layer.row_size), picked))
    return b"".join(parts)


def _rest(data: Buffer, stream: kvfile.Stream, picked: np.ndarray[Any, np.dtype[np.intp]]) -> bytes:
    """A chunked stream's cells after its last whole chunk, framed as llama-server frames a stream."""
    out = bytearray(struct.pack("<I", len(picked)))
    if not len(picked):
        return bytes(out)
    out += _take(_rows(data, stream.meta_start, stream.cells, _record(stream)), picked)
    out += data[stream.meta_end:stream.k[0].header]  # v_trans, n_layer (and the rotation words)
    for layer in stream.k:
        out += data[layer.header:layer.start]
        out += _take(_rows(data, layer.start, stream.cells, layer.row_size), picked)
    for layer in stream.v:
        out += data[layer.header:layer.start]
        if layer.transposed:
            out += _take(_columns(data, layer, stream.cells), picked, axis=1)
        else:
            out += _take(_rows(data, layer.start, stream.cells, layer.row_size), picked)
    return bytes(out)


def _stream_start(stream: kvfile.Stream) -> int:
    return stream.meta_start - 4  # its u32 cell count


def _stream_end(stream: kvfile.Stream) -> int:
    last = stream.v[-1]
    return last.start + last.row_size * stream.cells


# -- assembling -------------------------------------------------------------------------------------------------


def _assemble_stream(tail: Buffer, stream: kvfile.Stream, spec: dict[str, Any], chunks: Sequence[Buffer],
                     offset: int, per: int, out: BinaryIO) -> int:
    rest = stream.cells
    if rest and not _same_layout(stream, spec, tail):
        raise NotAssembled(f"the tail's stream {spec['section']}/{spec['stream']} is not of the chunks' layout")
    total = per * len(chunks) + rest
    record = 12 + int(spec["cell_ext"])
    views = [memoryview(chunk)[offset:offset + per * _cell_bytes(spec)] for chunk in chunks]
    written = out.write(struct.pack("<I", total))
    at = 0

    def each(width: int) -> list[memoryview]:
        nonlocal at
        parts = [view[at:at + per * width] for view in views]
        at += per * width
        return parts

    for part in each(record):
        written += out.write(part)
    if rest:
        written += out.write(tail[stream.meta_start:stream.meta_end])
    rot_k, rot_v = (int(r) for r in spec["rot"])
    frame = struct.pack("<IIII", int(spec["v_trans"]), len(spec["k"]), rot_k, rot_v) if spec["rot_written"] \
        else struct.pack("<II", int(spec["v_trans"]), len(spec["k"]))
    written += out.write(frame)
    for index, (type_id, row) in enumerate(spec["k"]):
        written += out.write(struct.pack("<iQ", int(type_id), int(row)))
        for part in each(int(row)):
            written += out.write(part)
        if rest:
            layer = stream.k[index]
            written += out.write(tail[layer.start:layer.start + rest * layer.row_size])
    for index, v in enumerate(spec["v"]):
        type_id, row = int(v[0]), int(v[1])
        parts = each(row)
        if len(v) > 2:  # transposed: each of its rows is every cell's element, chunk after chunk
            element, n_embd = int(v[2]), int(v[3])
            written += out.write(struct.pack("<iII", type_id, element, n_embd))
            blocks = [np.frombuffer(part, dtype=np.uint8).reshape(n_embd, per * element) for part in parts]
            if rest:
                layer = stream.v[index]
                blocks.append(np.frombuffer(tail, dtype=np.uint8, count=rest * row, offset=layer.start)
                              .reshape(n_embd, rest * element))
            written += out.write(np.hstack(blocks).tobytes() if blocks else b"")
            continue
        written += out.write(struct.pack("<iQ", type_id, row))
        for part in parts:
            written += out.write(part)
        if rest:
            layer = stream.v[index]
            written += out.write(tail[layer.start:layer.start + rest * layer.row_size])
    return written


def _same_layout(stream: kvfile.Stream, spec: dict[str, Any], tail: Buffer) -> bool:
    return _spec(int(spec["section"]), int(spec["stream"]), stream, tail) == spec
