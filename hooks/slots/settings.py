"""The slot built-ins' section of the config (`slots:`): the folder, the sliding-window rule, the warm-up after a
start. Keys that moved from it (the conversation cache's, the object store's) fail with the name of the new one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hooks.store.settings import MOVED_FROM_SLOTS
from wrapper.configuration.settings import COUNT, PATH, Section, choice, setting

FAMILY = "slots"


@dataclass(frozen=True)
class SlotSettings:
    dir: Path = setting(Path("~/.cache/llama-wrapper/slots").expanduser(), PATH,
                        "where slot files are kept, one folder per model id (also `--slots-dir`)")
    swa_full: str = setting("auto", choice("auto", "always", "never"),
                            "add `--swa-full` so that restored slots of sliding-window models are reused")
    warm: int = setting(16, COUNT, "after a start, prefill at most this many slots `slots.restore` could not use "
                        "(saved by another build that does not convert, or in other cache types), one at a time "
                        "while no request is in flight; 0: none (their next turn prefills them)")


MOVED = {"cache": "cache.enabled", "cache_budget": "store.budget", "cache_entry_max": "store.entry_max",
         "cache_min_free": "store.min_free", "min_tokens": "cache.min_tokens",
         "restore_margin": "cache.restore_margin", "restore_rate": "cache.restore_rate",
         **MOVED_FROM_SLOTS}  # slots.<key> ->
SLOTS = Section(FAMILY, SlotSettings, "slot persistence (`slots.save`, `slots.restore`)", moved=MOVED)
