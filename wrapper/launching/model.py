"""The model the server runs: its path, a name, and an id that fingerprints the GGUF file cheaply."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from wrapper.configuration import argv as args

_SAMPLE = 1 << 20  # bytes hashed at each end of the file: the header (metadata) and the last tensor data


@dataclass(frozen=True)
class Model:
    path: str | None
    name: str
    id: str

    def as_dict(self) -> dict[str, str | None]:
        return {"path": self.path, "name": self.name, "id": self.id}


def fingerprint(path: str) -> str:
    """sha256 of the size, the first and the last MiB: enough to tell GGUFs apart, quick even at 100 GB."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    digest.update(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(_SAMPLE))
        if size > _SAMPLE:
            handle.seek(max(_SAMPLE, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()[:16]


def from_argv(argv: list[str]) -> Model:
    """The model named by `-m`; without one (e.g. `-hf`) the id falls back to a hash of the argv."""
    path = args.get(argv, args.MODEL)
    if path and os.path.isfile(path):
        resolved = str(Path(path).resolve())
        return Model(resolved, Path(path).name.removesuffix(".gguf"), fingerprint(resolved))
    digest = hashlib.sha256("\0".join(argv[1:]).encode()).hexdigest()[:16]
    return Model(path, Path(path).name.removesuffix(".gguf") if path else "model", f"argv-{digest}")
