"""GGUF metadata read from the header, arrays skipped."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from wrapper.gguf_meta import architecture_facts, read_metadata


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
