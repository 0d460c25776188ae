"""In the background: with `spec.when: alone`, switch the draft (a reload) when a crowd or being alone again
has lasted `spec.calm` and the rule says a switch pays; each decision logged with its figures."""

from __future__ import annotations

import asyncio
import time

import structlog

from hooks.asks import Draft, asking
from hooks.speculative.fit import speculates
from hooks.speculative.rule import decide
from hooks.speculative.settings import SPEC, switching
from hooks.speculative.state import STATE
from wrapper.metrics import METRICS
from wrapper.reload_ask import Reloaded, RolledBack, ask_reload
from wrapper.server.generation import Host

log = structlog.get_logger()

LOOK_EVERY_S = 5.0
RETRY_MAX_S = 600.0  # the longest a failed switch waits before the next try


async def switch_when_calm(host: Host) -> None:
    last: tuple[bool, bool, str] | None = None
    while True:
        settings = SPEC.of(host.current.config)
        await asyncio.sleep(min(LOOK_EVERY_S, max(0.2, settings.calm / 4)))
        generation = host.current
        if not switching(generation.config) or not speculates(generation.config.argv):
            continue
        kept = generation.shared.get(STATE)
        now = time.monotonic()
        crowd = kept.crowd_since is not None
        since = kept.crowd_since if kept.crowd_since is not None else kept.alone_since
        if now - since < settings.calm or now < kept.retry_at:
            continue
        running = speculates(generation.launch.argv)
        decision = decide(crowd, running, kept.measured(), settings.calm, kept.reload_s, settings.alone_speedup)
        if (crowd, running, decision.reason) != last:  # each new decision once, not every look
            log.info("spec.decision", **kept.decisions.made(draft=decision.draft, switch=decision.switch,
                                                     reason=decision.reason, **decision.figures))
            last = (crowd, running, decision.reason)
        if not decision.switch:
            continue
        # no request waits for a switch: it never cuts the streams it is for (given up if they outlast the drain)
        asked = await ask_reload(host, f"spec: {decision.reason}", asking(Draft(decision.draft)), cut=False)
        if not isinstance(asked, Reloaded):
            kept.off = not speculates(host.current.launch.argv)  # what runs, not what the failed switch asked
            kept.alone_since = time.monotonic()  # tried again after a calm period, not at the next look
            kept.crowd_since = kept.alone_since if kept.crowd_since is not None else None
            kept.failures += 1  # and each failure waits twice as long: a given-up switch held requests too
            wait_s = min(RETRY_MAX_S, settings.calm * 2 ** kept.failures)
            kept.retry_at = time.monotonic() + wait_s
            if isinstance(asked, RolledBack):
                kept.reload_s = max(kept.reload_s, float(asked.answer.get("downtime_ms") or 0) / 1000)
            log.warning("spec.switch_failed", draft=decision.draft, reason=asked.reason, retry_in_s=round(wait_s, 1),
                        charged_s=round(kept.reload_s, 3))
            continue
        kept.failures, kept.retry_at = 0, 0.0
        kept.switches += 1
        now = time.monotonic()  # the new configuration is given a calm period of its own to be measured
        kept.alone_since = now
        kept.crowd_since = now if kept.crowd_since is not None else None
        held_ms = float(asked.answer.get("downtime_ms") or 0) - float(asked.answer.get("drain_ms") or 0)
        kept.reload_s = max(0.0, held_ms) / 1000  # its own cost: not the wait for answers in flight
        METRICS.spec_switches.labels(draft="on" if decision.draft else "off").inc()
        log.info("spec.switched", draft=decision.draft, downtime_ms=asked.answer.get("downtime_ms"))
        last = None
