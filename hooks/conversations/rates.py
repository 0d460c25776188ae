"""The rates the restore-or-prefill rule predicts with, measured per model on this machine and kept in
`~/.cache/llama-wrapper/rates/<model-id>.json` (this machine's cache, not the shared slot folder)."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

from wrapper.launching.measured import MeasuredFile

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


class KeptRates:
    """A model's rates and the file they are kept in."""

    def __init__(self, model_id: str) -> None:
        self.file = MeasuredFile(model_id, every_s=SAVE_EVERY_S)
        self.rates = Rates()
        with contextlib.suppress(TypeError):
            self.rates = Rates(**self.file.read())

    def save(self, soon: bool = False) -> None:
        """Write them (`soon`: unless written within SAVE_EVERY_S)."""
        self.file.write(asdict(self.rates), now=not soon)
