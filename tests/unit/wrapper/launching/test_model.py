"""The model fingerprint."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wrapper.launching.model import fingerprint


def test_fingerprint_tells_files_apart_at_either_end(tmp_path: Path) -> None:
    """The id of a model: the size, the first and the last MiB. Same bytes, same id; a change there, another."""
    body = bytearray(np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    ids = []
    for change in (None, 10, len(body) - 10, len(body) // 2):
        data = bytearray(body)
        if change is not None:
            data[change] ^= 0xFF
        path = tmp_path / f"m{change}.gguf"
        path.write_bytes(bytes(data))
        ids.append(fingerprint(str(path)))
    original, head, tail, middle = ids
    assert len(original) == 16 and int(original, 16) >= 0
    assert head != original and tail != original  # the metadata and the last tensor are sampled
    assert middle == original  # the middle is not read: that is what keeps it quick on 100 GB
    (tmp_path / "longer.gguf").write_bytes(bytes(body) + b"\0")
    assert fingerprint(str(tmp_path / "longer.gguf")) != original  # the size is part of it
