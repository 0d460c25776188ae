"""Slot-file conversion between KV cache types, checked against gguf-py's reference code and the file format."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize

from hooks.kvfile.convert import NotConvertible, _encode, convert, hadamard, rotate, target_rotation
from hooks.kvfile.format import MAGIC, read


def test_the_hadamard_matrix_is_llama_cpps() -> None:
    for n in (64, 128, 256):
        matrix = hadamard(n)
        assert np.allclose(matrix @ matrix, np.eye(n), atol=1e-5)  # orthonormal and its own inverse
        assert np.allclose(matrix, matrix.T) and matrix[0, 0] == pytest.approx(1 / np.sqrt(n))
        signs = np.array([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)])  # Sylvester's
        assert np.array_equal(np.sign(matrix), signs)


def test_rotate_applies_the_matrix_to_each_chunk() -> None:
    values = np.random.default_rng(0).standard_normal((5, 512)).astype(np.float32)
    chunks = values.reshape(-1, 128)
    expected = np.stack([hadamard(128) @ chunk for chunk in chunks]).reshape(values.shape)
    assert np.allclose(rotate(values, 128), expected, atol=1e-5)
    assert np.allclose(rotate(rotate(values, 64), 64), values, atol=1e-5)


@pytest.mark.parametrize(("name", "qtype"), [("q8_0", QType.Q8_0), ("q4_0", QType.Q4_0)])
def test_quantization_is_bit_exact_with_gguf_py(name: str, qtype: QType) -> None:
    values = np.random.default_rng(1).standard_normal((300, 256)).astype(np.float32)
    values[0, :32] = 0  # an all-zero block
    values[1, :32] = 2.5  # ties
    values[2, 3], values[2, 7] = -3.0, 3.0  # a tie of opposite signs: the first one counts (q4_0's sign)
    values[2, 37], values[2, 41] = 3.0, -3.0
    assert np.array_equal(_encode(values.reshape(-1), name).reshape(-1), quantize(values, qtype).reshape(-1))


def test_target_rotation_follows_llama_cpps_rule() -> None:
    assert target_rotation("q8_0", 256, for_keys=True, disabled=False) == 256  # Gemma 3's head
    assert target_rotation("q8_0", 256, for_keys=False, disabled=False) == 64
    assert target_rotation("q4_0", 64, for_keys=True, disabled=False) == 64
    assert target_rotation("q8_0", 96, for_keys=True, disabled=False) == 0  # not a multiple of 64
    assert target_rotation("q8_0", 32, for_keys=True, disabled=False) == 0
    assert target_rotation("f16", 128, for_keys=True, disabled=False) == 0
    assert target_rotation("q8_0", 128, for_keys=True, disabled=True) == 0


def slot_file(path: Path, k: np.ndarray, v: np.ndarray, v_trans: int = 0, sections: int = 1,
              version: int = 4) -> None:
    """A one-stream f16 slot file of `len(k)` cells: tokens, cell metadata, K and V per layer; `version` 2 as
    llama.cpp b9095 writes it (plain tokens, no rotation words)."""
    layers, cells, n_embd = k.shape
    tokens = list(range(cells))
    words = [-1, 1, cells, *tokens, 0] if version >= 4 else tokens
    out = struct.pack("<III", MAGIC, version, len(words)) + struct.pack(f"<{len(words)}i", *words)
    for _ in range(sections):
        out += struct.pack("<II", 1, cells) + b"".join(struct.pack("<iIi", p, 1, 0) for p in range(cells))
        out += struct.pack("<IIII", v_trans, layers, 0, 0) if version >= 4 else struct.pack("<II", v_trans, layers)
        for layer in range(layers):
            out += struct.pack("<iQ", 1, 2 * n_embd) + k[layer].astype("<f2").tobytes()
        for layer in range(layers):
            record = struct.pack("<iII", 1, 2, n_embd) if v_trans else struct.pack("<iQ", 1, 2 * n_embd)
            out += record + v[layer].astype("<f2").tobytes()
    path.write_bytes(out)


def kv_rows(path: Path, cells: int, n_embd: int, layers: int, qtype: QType,
            words: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Read the K and V rows back out of a converted file (one section; `words`: its token words)."""
    data = path.read_bytes()
    pos = 12 + 4 * (cells + 4 if words is None else words) + 8 + 12 * cells + 16
    found = []
    for _ in range(2 * layers):
        _, row_size = struct.unpack_from("<iQ", data, pos)
        pos += 12
        raw = np.frombuffer(data, dtype=np.uint8, count=cells * row_size, offset=pos).reshape(cells, row_size)
        found.append(dequantize(raw, qtype).reshape(cells, n_embd))
        pos += cells * row_size
    return np.stack(found[:layers]), np.stack(found[layers:])


@pytest.mark.parametrize(("target", "qtype", "tolerance"), [("q8_0", QType.Q8_0, 0.03), ("q4_0", QType.Q4_0, 0.3)])
def test_a_converted_file_holds_the_rotated_quantized_cache(tmp_path: Path, target: str, qtype: QType,
                                                            tolerance: float) -> None:
    layers, cells, n_embd = 3, 40, 128
    rng = np.random.default_rng(2)
    k = rng.standard_normal((layers, cells, n_embd)).astype(np.float16)
    v = rng.standard_normal((layers, cells, n_embd)).astype(np.float16)
    source, converted = tmp_path / "f16.bin", tmp_path / f"{target}.bin"
    slot_file(source, k, v, sections=2)  # a sliding-window model writes two sections
    done = convert(source, converted, target, target, 128, 64)
    assert done.bytes_in == source.stat().st_size and done.bytes_out == converted.stat().st_size
    parsed = read(converted)
    assert parsed.tokens == list(range(cells)) and parsed.kv is not None
    assert (parsed.kv.k_types, parsed.kv.v_types) == ([target] * layers, [target] * layers)
    assert (parsed.kv.n_rot_k, parsed.kv.n_rot_v) == (128, 64)
    k_back, v_back = kv_rows(converted, cells, n_embd, layers, qtype)
    assert np.abs(rotate(k_back, 128) - k.astype(np.float32)).max() < tolerance * 4  # rotation undone: K again
    assert np.abs(rotate(v_back, 64) - v.astype(np.float32)).max() < tolerance * 4
    back = tmp_path / "back.bin"
    convert(converted, back, "f16", "f16", 0, 0)  # and back to f16, unrotated
    assert read(back).kv is not None and read(back).kv.n_rot_k == 0  # type: ignore[union-attr]
    assert back.stat().st_size == source.stat().st_size


def test_what_is_not_converted_says_why(tmp_path: Path) -> None:
    k = np.zeros((2, 8, 64), dtype=np.float16)
    transposed = tmp_path / "t.bin"
    slot_file(transposed, k, k, v_trans=1)
    with pytest.raises(NotConvertible, match="transposed"):
        convert(transposed, tmp_path / "out.bin", "q8_0", "q8_0", 64, 64)
    with pytest.raises(NotConvertible, match="cannot be converted to"):
        convert(transposed, tmp_path / "out.bin", "iq4_nl", "q8_0", 0, 0)
    with pytest.raises(NotConvertible, match="another path"):
        convert(transposed, transposed, "q8_0", "q8_0", 0, 0)
    truncated = tmp_path / "short.bin"
    truncated.write_bytes(transposed.read_bytes()[:100])
    with pytest.raises(NotConvertible, match="truncated"):
        convert(truncated, tmp_path / "out.bin", "q8_0", "q8_0", 0, 0)


def test_a_conversion_says_how_far_it_is(tmp_path: Path) -> None:
    k = np.random.default_rng(2).standard_normal((3, 16, 64)).astype(np.float16)
    source = tmp_path / "s.bin"
    slot_file(source, k, k, sections=2)
    seen: list[tuple[int, int]] = []
    convert(source, tmp_path / "d.bin", "q8_0", "q8_0", 0, 0, lambda done, size: seen.append((done, size)))
    assert len(seen) == 2 * 2 * 3  # every layer of K and V, in both sections
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)
    assert seen[-1] == (source.stat().st_size, source.stat().st_size)


def test_a_state_of_an_earlier_build_converts_into_the_version_this_one_reads(tmp_path: Path) -> None:
    """b9095 writes state version 2 (no rotation words after n_layer, plain tokens); b11434 reads only 4. The
    same KV, converted, is byte for byte what the newer build writes for it, and quantizes the same way."""
    layers, cells, n_embd = 2, 24, 128
    rng = np.random.default_rng(5)
    k = rng.standard_normal((layers, cells, n_embd)).astype(np.float16)
    v = rng.standard_normal((layers, cells, n_embd)).astype(np.float16)
    old, new = tmp_path / "v2.bin", tmp_path / "v4.bin"
    slot_file(old, k, v, sections=2, version=2)
    slot_file(new, k, v, sections=2, version=4)
    parsed = read(old)
    assert parsed.version == 2 and parsed.kv is not None and parsed.kv.sections == 2
    assert parsed.kv.n_layer == layers and parsed.kv.cells == [cells] and parsed.tokens == list(range(cells))
    upgraded = tmp_path / "up.bin"
    convert(old, upgraded, "f16", "f16", 0, 0)
    after = read(upgraded)
    assert after.version == 4 and after.tokens == list(range(cells))
    new_words = 12 + 4 * (cells + 4)
    old_words = 12 + 4 * cells
    assert upgraded.read_bytes()[old_words:] == new.read_bytes()[new_words:]  # the KV framed as b11434 frames it
    quantized_old, quantized_new = tmp_path / "q-old.bin", tmp_path / "q-new.bin"
    convert(old, quantized_old, "q8_0", "q8_0", 128, 64)
    convert(new, quantized_new, "q8_0", "q8_0", 128, 64)
    assert quantized_old.read_bytes()[old_words:] == quantized_new.read_bytes()[new_words:]


def test_an_earlier_builds_rotated_cache_is_read_with_its_implied_rotation(tmp_path: Path) -> None:
    """A version-2 q8_0 cache is rotated (b9095 rotates quantized caches) but does not say so: `implied` gives
    the rotation its server used, and the conversion to f16 undoes it."""
    layers, cells, n_embd = 2, 16, 64
    k = np.random.default_rng(6).standard_normal((layers, cells, n_embd)).astype(np.float16)
    f16_v4, q8_v4 = tmp_path / "f16.bin", tmp_path / "q8.bin"
    slot_file(f16_v4, k, k)
    convert(f16_v4, q8_v4, "q8_0", "q8_0", 64, 64)
    data = q8_v4.read_bytes()  # the same file in version 2: the version word, plain tokens, no rotation words
    words_end = 12 + 4 * (cells + 4)
    meta_end = words_end + 8 + 12 * cells
    as_v2 = (struct.pack("<III", MAGIC, 2, cells) + struct.pack(f"<{cells}i", *range(cells))
             + data[words_end:meta_end + 8] + data[meta_end + 16:])
    old = tmp_path / "old-q8.bin"
    old.write_bytes(as_v2)
    assert read(old).kv is not None
    back = tmp_path / "back.bin"
    convert(old, back, "f16", "f16", 0, 0, implied=(64, 64))
    k_back, _ = kv_rows(back, cells, n_embd, layers, QType.F16, words=cells)
    assert np.abs(k_back - k.astype(np.float32)).max() < 0.12  # unrotated: the values it started from
    wrong = tmp_path / "wrong.bin"
    convert(old, wrong, "f16", "f16", 0, 0)  # taken as unrotated, it would be another K
    k_wrong, _ = kv_rows(wrong, cells, n_embd, layers, QType.F16, words=cells)
    assert np.abs(k_wrong - k.astype(np.float32)).max() > 0.5
