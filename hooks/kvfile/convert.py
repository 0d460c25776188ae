"""Convert a slot file's KV cache to other cache types (f16, f32, q8_0, q4_0), so a reload that changes
`-ctk/-ctv` restores the conversation instead of prefilling it again.

The layout is read exactly as llama.cpp writes it (see hooks/kvfile/format.py): header and tokens are copied,
and each KV section (two for sliding-window models: the global one, then the SWA one) is rewritten layer by
layer: dequantize, undo the source's Hadamard rotation, apply the target's, quantize. Quantized caches are
rotated by default: each chunk of `n_rot` values of a row is multiplied by the orthonormal Sylvester
Hadamard matrix H (H·H = I), so undoing and applying are the same product. Files with a transposed V
(flash attention off) or several sequences per cell are not converted; M-RoPE cells are copied as they are.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGMLQuantizationType as QType
from gguf.quants import Q4_0, Q8_0

from hooks import kvfile

TYPES = {"f32": QType.F32, "f16": QType.F16, "q8_0": QType.Q8_0, "q4_0": QType.Q4_0}
_BY_ID = {int(qtype): name for name, qtype in TYPES.items()}
_ELEMENTS = {"f32": (1, 4), "f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}  # values, bytes per block
PIECE_BYTES = 1 << 20  # input converted at a time: cache-sized, and bounded memory whatever the file size
WORKERS = max(1, min(8, os.cpu_count() or 1))  # pieces converted at once (numpy leaves the GIL to them)
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvconvert")
    return _POOL


WRITES = kvfile.ROT_WRITTEN  # the state version a conversion writes (llama.cpp b11434's)


class NotConvertible(Exception):
    """A file this converter does not rewrite; the caller falls back to prefilling its tokens."""


@dataclass(frozen=True)
class Conversion:
    bytes_in: int
    bytes_out: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes_in / 1e6 / self.seconds if self.seconds > 0 else float("inf")


@functools.cache
def hadamard(n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """llama.cpp's orthonormal Walsh-Hadamard matrix of size n (a power of two): Sylvester's, over sqrt(n)."""
    matrix = np.ones((1, 1), dtype=np.float32)
    while matrix.shape[0] < n:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return np.asarray(matrix / np.sqrt(np.float32(n)), dtype=np.float32)


def rotate(values: np.ndarray[Any, np.dtype[np.float32]], n: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Each chunk of n values times `hadamard(n)` (one matrix product, which the BLAS runs on every core:
    faster here than a butterfly or two Kronecker factors)."""
    return np.asarray(values.reshape(-1, n) @ hadamard(n), dtype=np.float32).reshape(values.shape)


def target_rotation(type_name: str, head_dim: int | None, for_keys: bool, disabled: bool) -> int:
    """The n_rot a server gives a new cache of this type (llama-kv-cache.cpp's rule)."""
    if disabled or type_name in ("f32", "f16", "bf16") or not head_dim or head_dim % 64:
        return 0
    n_rot = 64
    while for_keys and head_dim % (2 * n_rot) == 0:
        n_rot *= 2
    return n_rot


def convert(src: Path, dst: Path, type_k: str, type_v: str, rot_k: int, rot_v: int,
            progress: Callable[[int, int], None] | None = None, implied: tuple[int, int] = (0, 0)) -> Conversion:
    """Write `src`'s slot state to `dst` in state version 4 with K/V cache types `type_k`/`type_v` and rotations
    `rot_k`/`rot_v`; `progress(bytes read, bytes in all)` after each layer. A source of an earlier state version
    (llama.cpp b9095 writes 2) is read in its framing; its rotation, which it does not write, is `implied`
    (K, V: what its server gave its cache types)."""
    for name in (type_k, type_v):
        if name not in TYPES:
            raise NotConvertible(f"cache type {name} cannot be converted to (only {', '.join(TYPES)})")
    if dst.exists() and dst.samefile(src):
        raise NotConvertible("the converted file must go to another path than its source")
    started = time.monotonic()
    try:
        data, size = kvfile.open_map(src)
    except OSError as exc:
        raise NotConvertible(f"cannot read {src}: {exc.strerror}") from exc
    try:
        head = kvfile.header(data, str(src))
        if head.version not in kvfile.READS:
            raise NotConvertible(f"not a slot file with a KV layout this converter knows (version {head.version})")
        # the whole layout checked before a byte is written
        sections = list(kvfile.walk(data, head.words_end, head.version))
        with open(dst, "wb") as out:
            out.write(bytes(data[:4]) + struct.pack("<I", WRITES) + bytes(data[8:head.words_end]))
            for section in sections:
                _section(data, section, out, type_k, type_v, rot_k, rot_v, progress and (lambda at: progress(at, size)),
                         implied)
            out.flush()
            os.fsync(out.fileno())
    except kvfile.SlotFileError as exc:
        raise NotConvertible(str(exc)) from exc
    finally:
        if isinstance(data, mmap.mmap):
            data.close()
    return Conversion(size, os.path.getsize(dst), time.monotonic() - started)


def _section(data: kvfile.Buffer, section: kvfile.Section, out: BinaryIO, type_k: str, type_v: str,
             rot_k: int, rot_v: int, done: Callable[[int], None] | None, implied: tuple[int, int]) -> None:
    out.write(struct.pack("<I", len(section.streams)))
    for stream in section.streams:
        out.write(struct.pack("<I", stream.cells))
        if stream.cells == 0:
            continue
        if stream.v_trans:
            raise NotConvertible("V is stored transposed (flash attention off): not converted")
        if not stream.one_sequence:
            raise NotConvertible("cells with several sequences: not converted")
        if stream.cell_ext == 8:
            raise NotConvertible("M-RoPE cells of an earlier state version lack the token the newer layout keeps")
        src_k, src_v = (stream.n_rot_k, stream.n_rot_v) if stream.rot_written else implied
        out.write(data[stream.meta_start:stream.meta_end])
        out.write(struct.pack("<IIII", 0, len(stream.k), rot_k, rot_v))
        for layer in stream.k:
            _layer(data, layer, out, stream.cells, type_k, src_k, rot_k)
            if done is not None:
                done(layer.start + layer.row_size * stream.cells)
        for layer in stream.v:
            _layer(data, layer, out, stream.cells, type_v, src_v, rot_v)
            if done is not None:
                done(layer.start + layer.row_size * stream.cells)


def _layer(data: kvfile.Buffer, layer: kvfile.Layer, out: BinaryIO, cells: int, target: str, src_rot: int,
           dst_rot: int) -> None:
    source = _BY_ID.get(layer.type_id)
    if source is None:
        raise NotConvertible(f"cache type id {layer.type_id} cannot be converted from")
    row_size = layer.row_size
    per_block, block_bytes = _ELEMENTS[source]
    if row_size % block_bytes:
        raise NotConvertible(f"a row of {row_size} bytes is not whole {source} blocks")
    n_embd = row_size // block_bytes * per_block
    out_per_block, out_block_bytes = _ELEMENTS[target]
    if n_embd % out_per_block or (src_rot and n_embd % src_rot) or (dst_rot and n_embd % dst_rot):
        raise NotConvertible(f"rows of {n_embd} values do not split into {target} blocks or rotation chunks")
    out.write(struct.pack("<iQ", int(TYPES[target]), n_embd // out_per_block * out_block_bytes))
    rows = np.frombuffer(data, dtype=np.uint8, count=cells * row_size, offset=layer.start).reshape(cells, row_size)
    if source == target and src_rot == dst_rot:
        out.write(rows.tobytes())
        return
    per_piece = max(1, PIECE_BYTES // row_size)
    pieces = (rows[first:first + per_piece] for first in range(0, cells, per_piece))
    convert_one: Callable[[Any], bytes] = lambda piece: _piece(piece, source, target, src_rot, dst_rot)  # noqa: E731
    # a rotation's product runs on every core already: pieces on threads beside it only fight over them
    converted = map(convert_one, pieces) if src_rot or dst_rot else _in_order(convert_one, pieces)
    for done in converted:
        out.write(done)


def _piece(piece: np.ndarray[Any, np.dtype[np.uint8]], source: str, target: str, src_rot: int,
           dst_rot: int) -> bytes:
    values = _decode(np.ascontiguousarray(piece), source)
    if src_rot:
        values = rotate(values, src_rot)  # H·H = I: the same product undoes the source's rotation
    if dst_rot:
        values = rotate(values, dst_rot)
    return _encode(values, target).tobytes()


def _in_order(work: Callable[[Any], bytes], items: Iterator[Any]) -> Iterator[bytes]:
    """`work` over `items` on WORKERS threads, results in order, at most 2 x WORKERS pieces in memory."""
    pool, pending = _pool(), []
    for item in items:
        pending.append(pool.submit(work, item))
        if len(pending) >= 2 * WORKERS:
            yield pending.pop(0).result()
    for future in pending:
        yield future.result()


def _decode(piece: np.ndarray[Any, np.dtype[np.uint8]], source: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Rows of `source`-typed bytes as float32 values, all blocks at once."""
    if source == "f32":
        return piece.view("<f4").reshape(-1)
    if source == "f16":
        return piece.view("<f2").astype(np.float32).reshape(-1)
    blocks = piece.reshape(-1, _ELEMENTS[source][1])
    quant = Q8_0 if source == "q8_0" else Q4_0  # gguf-py's block code
    return np.asarray(quant.dequantize_blocks(blocks), dtype=np.float32).reshape(-1)


def _encode(values: np.ndarray[Any, np.dtype[np.float32]], target: str) -> np.ndarray[Any, np.dtype[np.uint8]]:
    if target == "f32":
        return values.astype("<f4").view(np.uint8)
    if target == "f16":
        return values.astype("<f2").view(np.uint8)
    blocks = values.reshape(-1, 32)
    out = np.empty((len(blocks), _ELEMENTS[target][1]), dtype=np.uint8)
    if target == "q8_0":  # ggml's: d = max|x| / 127, q = round(x / d); in place, one scratch array
        work = np.abs(blocks)
        d = work.max(axis=1)
        d /= np.float32(127)
        scale = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        np.multiply(blocks, scale[:, None], out=work)
        np.rint(work, out=out[:, 2:].view(np.int8), casting="unsafe")  # rounded and narrowed in one pass
    else:  # q4_0, ggml's: d = (the value of largest magnitude) / -8, q = clamp(trunc(x / d + 8.5), 0, 15)
        d = _largest(blocks) / np.float32(-8)
        scale = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.trunc(blocks * scale[:, None] + np.float32(8.5)), 0, 15).astype(np.uint8)
        out[:, 2:] = q[:, :16] | (q[:, 16:] << np.uint8(4))
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    return out


def _largest(blocks: np.ndarray[Any, np.dtype[np.float32]]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Per block, the value of largest magnitude; on a tie between +m and -m the first one, as ggml's loop
    keeps it (found by a scan of those few blocks only)."""
    high, low = blocks.max(axis=1), blocks.min(axis=1)
    values = np.where(-low > high, low, high)
    tied = np.flatnonzero((-low == high) & (high != 0))
    if len(tied):
        rows = blocks[tied]
        values[tied] = rows[np.arange(len(tied)), np.abs(rows).argmax(axis=1)]
    return np.asarray(values, dtype=np.float32)
