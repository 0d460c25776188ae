"""The spec built-in's part of /wrapper/status and /metrics."""

from __future__ import annotations

import time
from typing import Any

from hooks.speculative.fit import speculates
from hooks.speculative.settings import SPEC
from hooks.speculative.state import STATE
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation


def status(generation: Generation) -> dict[str, Any]:
    kept, settings = generation.shared.get(STATE), SPEC.of(generation.config)
    now = time.monotonic()
    return {"when": settings.when, "configured": speculates(generation.config.argv),
            "running": speculates(generation.launch.argv), "decoding": len(kept.tracks),
            "crowd_for_s": None if kept.crowd_since is None else round(now - kept.crowd_since, 1),
            "alone_for_s": None if kept.crowd_since is not None else round(now - kept.alone_since, 1),
            "rates": kept.measured().__dict__, "drafted": kept.drafted, "accepted": kept.accepted,
            "switches": kept.switches, "reload_s": kept.reload_s, "decisions": list(kept.decisions)}


def metrics(generation: Generation) -> None:
    METRICS.spec_running.set(1 if speculates(generation.launch.argv) else 0)
