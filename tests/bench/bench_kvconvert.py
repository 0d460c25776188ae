"""KV conversion speed: a slot file of f16 KV converted to q8_0 and q4_0 (with and without the rotation a
quantized cache gets), on WORKERS threads against one, side by side in one run. No llama-server needed: the
file is written in the layout llama-server writes (tests/slotfiles.py), with random values.

    python tests/bench/bench_kvconvert.py [--layers 12] [--cells 4096] [--width 512]
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hooks.kvfile import convert as kvconvert
from tests.slotfiles import slot_bytes


def slot_file(path: Path, layers: int, cells: int, width: int) -> int:
    """A one-stream f16 slot file of `layers` x `cells` x `width` values for K and V, random; its size."""
    head = slot_bytes(list(range(cells)), n_layer=0, cells=0)
    head = head[:-struct.calcsize("<II") - struct.calcsize("<IIII")]  # the empty section, written below
    rng = np.random.default_rng(0)
    with open(path, "wb") as out:
        out.write(head + struct.pack("<II", 1, cells))
        for pos in range(cells):
            out.write(struct.pack("<iIi", pos, 1, 0))
        out.write(struct.pack("<IIII", 0, layers, 0, 0))
        for _ in range(2 * layers):
            out.write(struct.pack("<iQ", 1, width * 2))
            out.write(rng.standard_normal(cells * width, dtype=np.float32).astype("<f2").tobytes())
    return path.stat().st_size


def rate(src: Path, dst: Path, target: str, rot: int) -> float:
    best = 0.0
    for _ in range(3):
        began = time.monotonic()
        done = kvconvert.convert(src, dst, target, target, rot, rot)
        best = max(best, done.bytes_in / 1e6 / (time.monotonic() - began))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--cells", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        src, dst = Path(name) / "f16.bin", Path(name) / "out.bin"
        size = slot_file(src, options.layers, options.cells, options.width)
        print(f"{size / 1e6:.0f} MB of f16 KV ({options.layers} layers x {options.cells} cells x {options.width})")
        workers = kvconvert.WORKERS
        rows = []
        for target in ("q8_0", "q4_0"):
            for rot in (0, 64):
                kvconvert.WORKERS, kvconvert._POOL = 1, None
                one = rate(src, dst, target, rot)
                kvconvert.WORKERS, kvconvert._POOL = workers, None
                many = rate(src, dst, target, rot)
                rows.append((target, rot, one, many))
        print(f"{'':26}{'1 thread':>12}{f'{workers} threads':>12}")
        for target, rot, one, many in rows:
            label = f"f16->{target}" + (f", rotated {rot}" if rot else "")
            print(f"{label:26}{one:>7.0f} MB/s{many:>7.0f} MB/s")
        best = max(many for target, rot, _, many in rows if target == "q8_0" and rot == 0)
        rotated = max(many for target, rot, _, many in rows if target == "q8_0" and rot)
        print(f"kv conversion f16->q8_0: {best:.0f} MB/s ({rotated:.0f} MB/s rotated, as a quantized cache is "
              "by default)")


if __name__ == "__main__":
    main()
