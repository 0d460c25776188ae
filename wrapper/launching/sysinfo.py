"""How much memory this machine has free: MemAvailable, and a GPU's free memory where nvidia-smi says it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def mem_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable); None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_free() -> int | None:
    """Free bytes of the first GPU nvidia-smi lists; None without nvidia-smi or a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True)
        return int(done.stdout.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
