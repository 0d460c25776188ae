"""The switch loop with a scripted host: a switch the reload gives up (its answers outlasted the drain) waits
twice as long, and the requests it held count as its cost, so that the rule stops a switch that does not pay for
what it holds (no reload after reload, each holding every request)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, cast

from structlog.testing import capture_logs

from hooks.speculative import control
from hooks.speculative.state import STATE, Track
from wrapper import built_ins
from wrapper.kept import Kept
from wrapper.server.generation import Host

ARGV = ("llama-server", "-m", "m.gguf", "-md", "d.gguf", "--spec-type", "draft-simple", "-np", "3")


class Giving:
    """What serves: every reload is given up, having held requests for half a second."""

    def __init__(self) -> None:
        config = replace(built_ins.parse("spec: {when: alone, calm: 200ms}\n"), argv=ARGV)
        launch = type("L", (), {"argv": list(ARGV)})()
        self.current = type("G", (), {"config": config, "launch": launch, "shared": Kept()})()
        self.in_flight = 2
        self.asked = 0

    async def reload(self, body: dict[str, Any], why: str | None = None, asks: Any = None,
                     cut: bool = True) -> dict[str, Any]:
        assert cut is False  # a switch cuts no stream
        self.asked += 1
        return {"success": False, "message": "reload given up: requests in flight did not finish", "downtime_ms": 500}


async def test_a_given_up_switch_backs_off_and_charges_what_it_held() -> None:
    host = Giving()
    kept = host.current.shared.get(STATE)
    for _ in range(3):  # a crowd: three decode at once
        kept.began(Track(draft=True))
    kept.crowd_since = time.monotonic() - 1
    with capture_logs() as logs:
        switching = asyncio.ensure_future(control.switch_when_calm(cast(Host, host)))
        try:
            await asyncio.sleep(2.0)  # ten calm periods
        finally:
            switching.cancel()
    (failed,) = [e for e in logs if e["event"] == "spec.switch_failed"]
    assert failed["retry_in_s"] == 0.4 and failed["charged_s"] == 0.5  # twice spec.calm; the held half second
    assert host.asked == 1 and kept.failures == 1  # one try: a switch winning 0.07 s a calm period is not worth it
    later = [e for e in logs if e["event"] == "spec.decision" and not e["switch"]]
    assert later and "its reload costs 0.50s" in later[-1]["reason"]
