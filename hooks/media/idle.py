"""In the background: with the projector loaded on demand, drop it (a reload that keeps every conversation)
after `media.idle` without a request that carries media."""

from __future__ import annotations

import asyncio
import time

import structlog

from hooks.asks import Projector, asking
from hooks.media.settings import MEDIA, on_demand
from hooks.media.state import loaded, state
from wrapper.metrics import METRICS
from wrapper.reload_ask import Reloaded, ask_reload
from wrapper.server.generation import Host

log = structlog.get_logger()

LOOK_EVERY_S = 30.0


async def drop_when_idle(host: Host) -> None:
    while True:
        idle = MEDIA.of(host.current.config).idle
        await asyncio.sleep(min(LOOK_EVERY_S, max(0.25, idle / 4)))
        generation = host.current
        kept = state(generation)
        if not on_demand(generation.config) or not loaded(generation) or kept.in_flight:
            continue
        if kept.last_media_at is None:
            kept.last_media_at = time.monotonic()  # loaded by a reload of the user's: idle from now
        quiet = time.monotonic() - kept.last_media_at
        if quiet < idle:
            continue
        asked = await ask_reload(host, f"media: no request with media for {quiet:.0f}s (media.idle {idle:g}s)",
                                 asking(Projector(wanted=False)), cut=False)  # an answer in flight finishes
        if not loaded(host.current) and isinstance(asked, Reloaded):
            kept.drops += 1
            METRICS.projector_changes.labels(change="dropped").inc()
            log.info("media.projector_dropped", **kept.decisions.made(change="dropped", idle_s=round(quiet, 1),
                                                               downtime_ms=asked.answer.get("downtime_ms")))
        else:  # refused or rolled back: it still runs with the projector, and is asked again after media.idle
            kept.wanted = loaded(host.current)
            kept.last_media_at = time.monotonic()
