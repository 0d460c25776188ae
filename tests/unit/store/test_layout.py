"""The slot folder: a new pair replaces the old one in one step, whatever kills the save, and litter is swept."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hooks.store import layout
from tests.helpers import ROOT, wait_for
from tests.slotfiles import make_pair, slot_bytes


def current_pair(folder: Path) -> tuple[dict[str, object], Path]:
    (saved,) = layout.saved_slots(folder)
    sidecar = layout.read_sidecar(saved.sidecar)
    layout.check_pair(sidecar, saved.kv_file)  # raises unless the sidecar describes the file as it is
    return sidecar, saved.kv_file


def test_a_commit_replaces_the_pair_and_removes_the_old_file(tmp_path: Path) -> None:
    old = make_pair(tmp_path, "m", 0, [1, 2, 3])
    new = make_pair(tmp_path, "m", 0, [1, 2, 3, 4, 5])
    sidecar, kv_file = current_pair(tmp_path)
    assert kv_file == new and sidecar["tokens"] == 5 and not old.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["slot0.json", new.name])


@pytest.mark.parametrize("failing_step", [1, 2])
def test_a_commit_that_dies_midway_leaves_the_old_pair_whole(tmp_path: Path, failing_step: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 moves the new KV file under its own name, step 2 replaces the sidecar: die before either lands."""
    old = make_pair(tmp_path, "m", 0, [1, 2, 3])
    written = tmp_path / "slot0.bin.0.tmp"
    written.write_bytes(slot_bytes([1, 2, 3, 4]))
    real_replace, steps = os.replace, []

    def dying_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        steps.append(dst)
        if len(steps) == failing_step:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    with pytest.raises(OSError):
        layout.commit(tmp_path, 0, written, {"tokens": 4})
    monkeypatch.undo()
    sidecar, kv_file = current_pair(tmp_path)
    assert kv_file == old and sidecar["tokens"] == 3


def test_sigkill_at_any_moment_of_saves_leaves_a_whole_pair(tmp_path: Path) -> None:
    """A real process saving in a loop, SIGKILLed 12 times at random moments: each time a consistent pair."""
    script = (
        "import sys, os; sys.path.insert(0, sys.argv[2])\n"
        "from pathlib import Path\nfrom hooks.store import layout\n"
        "folder = Path(sys.argv[1]); n = 0\n"
        "while True:\n"
        "    n += 1\n"
        "    written = folder / f'slot0.bin.{os.getpid()}.tmp'\n"
        "    written.write_bytes(os.urandom(3 << 20) + n.to_bytes(8, 'little'))\n"
        "    layout.commit(folder, 0, written, {'tokens': n})\n"
        "    print(n, flush=True)\n"
    )
    make_pair(tmp_path, "m", 0, [1])
    rng = random.Random(7)
    seen_tokens = set()
    for _ in range(12):
        saver = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(ROOT)], stdout=subprocess.PIPE,
                                 text=True)
        assert saver.stdout is not None
        done = rng.randint(1, 3)  # saves done before the kill (counted, not timed: a busy machine saves slowly)
        for _ in range(done):
            saver.stdout.readline()
        time.sleep(rng.uniform(0, 0.05))  # then in the middle of the next one, or between two
        saver.send_signal(signal.SIGKILL)
        saver.wait()
        sidecar, _ = current_pair(tmp_path)
        tokens = sidecar["tokens"]
        assert isinstance(tokens, int) and tokens >= done
        seen_tokens.add(sidecar["tokens"])
        layout.sweep(tmp_path, now=time.time() + 2 * layout.ORPHAN_AGE_S)
        names = sorted(p.name for p in tmp_path.iterdir())
        assert len(names) == 2 and "slot0.json" in names, names  # the pair, nothing else left behind
    assert len(seen_tokens) > 1  # the kills landed at different saves


def test_sweep_removes_litter_of_dead_processes_only(tmp_path: Path) -> None:
    kv_file = make_pair(tmp_path, "m", 0, [1, 2])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    wait_for(lambda: not Path(f"/proc/{dead_pid}").exists(), 5, "the process to be gone")
    litter = [tmp_path / f"slot0.bin.{dead_pid}.tmp", tmp_path / f"slot0.json.{dead_pid}.tmp",
              tmp_path / f".probe-state-version.{dead_pid}.bin"]
    kept = [tmp_path / f"slot1.bin.{os.getppid()}.tmp"]  # a live process may still be writing it
    orphan, young_orphan = tmp_path / "slot0-0123456789ab.bin", tmp_path / "slot0-ba9876543210.bin"
    for path in (*litter, *kept, orphan, young_orphan):
        path.write_bytes(b"x")
    os.utime(orphan, (time.time() - 2 * layout.ORPHAN_AGE_S,) * 2)
    removed = layout.sweep(tmp_path)
    assert sorted(removed) == sorted(p.name for p in (*litter, orphan))
    assert kv_file.exists() and (tmp_path / "slot0.json").exists() and young_orphan.exists() and kept[0].exists()


def test_the_older_layout_is_still_read(tmp_path: Path) -> None:
    kv_file = make_pair(tmp_path, "m", 0, [1, 2])
    legacy = tmp_path / "slot0.bin"
    kv_file.rename(legacy)
    sidecar_file = tmp_path / "slot0.json"
    sidecar_file.write_text(sidecar_file.read_text().replace(f'"file": "{kv_file.name}",', ""))
    assert current_pair(tmp_path)[1] == legacy
