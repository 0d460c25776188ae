"""Each request that decodes: counted while it runs (how many decode at once), and what its answer's
`timings` say (tokens/s, drafted and accepted tokens). The step and the observer meet through a context
variable: the observer runs in the task that forwards the very request the step saw."""

from __future__ import annotations

import contextvars
import re

from hooks.speculative.fit import speculates
from hooks.speculative.settings import switching
from hooks.speculative.state import STATE, Track
from wrapper.server.generation import Generation, Host
from wrapper.steps import Observer, Outgoing

_TRACK: contextvars.ContextVar[Track | None] = contextvars.ContextVar("spec_track", default=None)
_PER_SECOND = re.compile(rb'"predicted_per_second"\s*:\s*([0-9.eE+-]+)')
_PREDICTED = re.compile(rb'"predicted_n"\s*:\s*(\d+)')
_DRAFT_N = re.compile(rb'"draft_n"\s*:\s*(\d+)')
_ACCEPTED = re.compile(rb'"draft_n_accepted"\s*:\s*(\d+)')


async def before(host: Host, out: Outgoing) -> Outgoing:
    generation = host.current
    if not switching(generation.config):
        return out
    kept = generation.shared.get(STATE)
    track = Track(draft=speculates(generation.launch.argv))
    kept.began(track)
    _TRACK.set(track)
    out.after.append(lambda _status: kept.ended(track))
    return out


def observer(generation: Generation) -> Observer | None:
    if not switching(generation.config):
        return None

    def seen(path: str, status: int, tail: bytes) -> None:
        track = _TRACK.get()
        if track is None or status != 200:
            return
        rate, predicted = _PER_SECOND.findall(tail), _PREDICTED.findall(tail)
        if rate and predicted:
            track.per_second, track.predicted = float(rate[-1]), int(predicted[-1])
        drafted, accepted = _DRAFT_N.findall(tail), _ACCEPTED.findall(tail)
        if drafted:
            track.drafted, track.accepted = int(drafted[-1]), int(accepted[-1]) if accepted else 0

    return seen
