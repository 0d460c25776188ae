"""GGUF metadata read from the header, arrays skipped."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from wrapper.launching.gguf_meta import GGUFError, architecture_facts, read_header, read_metadata


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


@pytest.mark.parametrize("seed", range(20))
def test_damage_after_the_magic_is_a_gguf_error_never_a_traceback(tmp_path: Path, seed: int) -> None:
    """A file that starts like a GGUF and goes on with noise (a cut download, a damaged disk)."""
    path = tmp_path / "damaged.gguf"
    noise = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + noise)
    with pytest.raises(GGUFError):
        read_header(str(path))
