"""The rates the restore-or-prefill rule predicts with, measured per model on this machine and kept in
`~/.cache/llama-wrapper/rates/<model-id>.json` (this machine's cache, not the shared slot folder)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from wrapper.server_help import cache_dir

EWMA = 0.3  # weight of the newest measurement in a rate
SAVE_EVERY_S = 10.0  # a learnt prefill rate is written at most this often


@dataclass
class Rates:
    """Prefill tokens per second, restore and conversion bytes per second; None until measured."""

    prefill_tps: float | None = None
    restore_bps: float | None = None
    convert_bps: float | None = None

    def learn_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:
            self.prefill_tps = _mix(self.prefill_tps, tokens / seconds)

    def learn_restore(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            self.restore_bps = _mix(self.restore_bps, nbytes / seconds)

    def learn_convert(self, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20 and seconds > 0:
            self.convert_bps = _mix(self.convert_bps, nbytes / seconds)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


def rates_dir() -> Path:
    return cache_dir().parent / "rates"


class KeptRates:
    """A model's rates and the file they are kept in."""

    def __init__(self, model_id: str) -> None:
        self.file = rates_dir() / f"{model_id}.json"
        self.rates = Rates()
        self._saved = 0.0
        with contextlib.suppress(OSError, ValueError, TypeError):
            self.rates = Rates(**json.loads(self.file.read_text()))

    def save(self, soon: bool = False) -> None:
        """Write them (`soon`: unless written within SAVE_EVERY_S)."""
        if soon and time.monotonic() - self._saved <= SAVE_EVERY_S:
            return
        self._saved = time.monotonic()
        temporary = self.file.with_name(f"{self.file.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(asdict(self.rates)))
            os.replace(temporary, self.file)
