"""What the spec built-in keeps for the wrapper's life: how many requests decode now and since when, the
tokens/s measured (alone and in a crowd, with and without the draft), the last reload's cost, its decisions.
The rates are kept on this machine per model and speculative setup (`~/.cache/llama-wrapper/rates/
<model-id>-spec-<setup>.json`), so that a wrapper llama-swap starts again does not learn them again."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hooks.decisions import Decisions
from hooks.speculative.rule import Rates
from wrapper.configuration import argv as args
from wrapper.kept import Key
from wrapper.launching.measured import MeasuredFile

WEIGHT = 0.3  # of a new measurement in the running average
SAVE_EVERY_S = 10.0
SETUP_FLAGS = ("-md", "--model-draft", "--spec-draft-model", "--spec-type", "--spec-draft-n-max", "-np",
               "--parallel", "-ngl", "--n-gpu-layers", "-t", "--threads")  # what the rates depend on


@dataclass
class Track:
    """One request that decodes: the most requests that decoded beside it (itself included), whether the draft
    ran, and what its answer's timings said."""

    draft: bool
    most: int = 1
    per_second: float | None = None
    predicted: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecState:
    off: bool = False  # the built-in dropped the draft (its fit leaves the spec flags out)
    tracks: dict[int, Track] = field(default_factory=dict)
    crowd_since: float | None = None
    alone_since: float = field(default_factory=time.monotonic)
    rates: dict[str, float] = field(default_factory=dict)  # alone_with, alone_without, crowd_with, crowd_without
    drafted: int = 0
    accepted: int = 0
    reload_s: float = 0.0  # the last switch's measured downtime (or a failed one's: the requests it held)
    switches: int = 0
    failures: int = 0  # switches in a row that did not take effect: each waits twice as long as the last
    retry_at: float = 0.0  # time.monotonic() before which no switch is tried again
    decisions: Decisions = field(default_factory=Decisions)
    file: MeasuredFile | None = None  # where the rates are kept (set by `keep`)

    def keep(self, model_id: str, argv: Sequence[str]) -> None:
        """Where this model's rates for this speculative setup are kept; read them when the setup is new (a
        reload that changed -np, -t, the draft... measures another setup)."""
        setup = json.dumps([[flag, args.get(argv, (flag,))] for flag in SETUP_FLAGS])
        name = f"{model_id}-spec-{hashlib.sha256(setup.encode()).hexdigest()[:12]}"
        if self.file is not None and self.file.path.stem == name:
            return
        self.save(now=True)  # the previous setup's, before its rates are left
        self.file, self.rates = MeasuredFile(name, every_s=SAVE_EVERY_S), {}
        with contextlib.suppress(TypeError, ValueError):
            found = self.file.read()
            self.rates.update({k: float(v) for k, v in found.items() if k in Rates.__dataclass_fields__})

    def save(self, now: bool = False) -> None:
        """Write the rates (at most every SAVE_EVERY_S unless `now`: a bucket measured for the first time)."""
        if self.file is not None:
            self.file.write(self.rates, now=now)

    def began(self, track: Track) -> None:
        self.tracks[id(track)] = track
        now = len(self.tracks)
        for each in self.tracks.values():
            each.most = max(each.most, now)
        if now > 1 and self.crowd_since is None:
            self.crowd_since = time.monotonic()

    def ended(self, track: Track) -> None:
        self.tracks.pop(id(track), None)
        if len(self.tracks) <= 1 and self.crowd_since is not None:
            self.crowd_since = None
            self.alone_since = time.monotonic()
        if track.per_second is None or track.predicted < 2:
            return
        self.drafted += track.drafted
        self.accepted += track.accepted
        bucket = f"{'crowd' if track.most > 1 else 'alone'}_{'with' if track.draft else 'without'}"
        rate = track.per_second * track.most  # the aggregate of the requests decoding at once
        old = self.rates.get(bucket)
        self.rates[bucket] = rate if old is None else (1 - WEIGHT) * old + WEIGHT * rate
        self.save(now=old is None)

    def measured(self) -> Rates:
        return Rates(**{k: round(v, 2) for k, v in self.rates.items()})



STATE = Key("spec", SpecState)
