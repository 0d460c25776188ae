"""A GGUF file's key/value header, read without loading tensors or building vocabularies.

gguf-py's GGUFReader parses the whole file (seconds for a 250 MB model, mostly vocabulary arrays); the
wrapper's start needs a handful of scalars, so this walks the header and skips array payloads.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

# value type id -> struct format of a scalar (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SMALL_ARRAY = 4096  # numeric arrays up to this length are kept (per-layer head counts, for instance)


class GGUFError(Exception):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    type_id: int  # ggml_type


def read_metadata(path: str) -> dict[str, Any]:
    """Scalar keys, strings and short numeric arrays of the GGUF header."""
    return read_header(path)[0]


def read_header(path: str) -> tuple[dict[str, Any], list[Tensor]]:
    """The key/value header and the tensor table (names, shapes, types; no data)."""
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(data)
    except (OSError, ValueError, OverflowError, RecursionError, struct.error) as exc:  # any damage, no traceback
        raise GGUFError(f"{path}: cannot read the GGUF header: {exc}") from exc


def _walk(data: mmap.mmap) -> tuple[dict[str, Any], list[Tensor]]:
    if data[:4] != b"GGUF":
        raise GGUFError("not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise GGUFError(f"GGUF version {version} is too old")
    if n_kv > len(data) or n_tensors > len(data):
        raise GGUFError(f"the header claims {n_kv} keys and {n_tensors} tensors: a damaged file")
    pos = 24
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _string(data, pos)
        (kind,) = struct.unpack_from("<I", data, pos)
        value, pos = _value(data, pos + 4, kind)
        if value is not _SKIPPED:
            out[key] = value
    tensors = []
    for _ in range(n_tensors):
        name, pos = _string(data, pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        if n_dims > 8:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
        shape = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        pos += 4 + 8 * n_dims
        type_id, _offset = struct.unpack_from("<IQ", data, pos)
        pos += 12
        tensors.append(Tensor(name, tuple(shape), type_id))
    return out, tensors


_SKIPPED = object()


def _string(data: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    start = pos + 8
    return data[start:start + length].decode("utf-8", "replace"), start + length


def _value(data: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)
    if kind == 8:
        return _string(data, pos)
    if kind != 9:
        raise GGUFError(f"unknown GGUF value type {kind}")
    item_kind, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item_kind in _SCALARS:
        width = struct.calcsize(_SCALARS[item_kind])
        if count <= _SMALL_ARRAY:
            fmt = "<" + _SCALARS[item_kind][1] * count
            return list(struct.unpack_from(fmt, data, pos)), pos + width * count
        return _SKIPPED, pos + width * count
    if item_kind == 8:  # string arrays (vocabularies): hop over each length-prefixed string
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(data, pos)[0]
        return _SKIPPED, pos
    for _ in range(count):  # arrays of arrays: rare, walk them
        _, pos = _value(data, pos, item_kind)
    return _SKIPPED, pos


def architecture_facts(meta: dict[str, Any]) -> dict[str, Any]:
    """The few facts the wrapper uses, under plain names."""
    arch = str(meta.get("general.architecture", ""))

    def key(name: str) -> Any:
        return meta.get(f"{arch}.{name}")

    window = key("attention.sliding_window")
    heads, embedding = key("attention.head_count"), key("embedding_length")
    plain_head = embedding // heads if isinstance(heads, int) and heads > 0 and isinstance(embedding, int) else None
    return {
        "architecture": arch,
        "context_length": key("context_length"),
        "block_count": key("block_count"),
        "sliding_window": window if isinstance(window, int) and window > 0 else None,
        "head_dim_k": key("attention.key_length") or plain_head,
        "head_dim_v": key("attention.value_length") or plain_head,
    }
