"""Whether the draft should run, from what was measured: a pure function with its unit-test table.

Alone, the draft runs when its speedup (tokens/s with it over without: `spec.alone_speedup` when given, else
both measured) is above 1; with nothing measured without it, as configured (on) — except after it was
dropped, when it stays off until a request alone has run without it, so that a switch back is measured,
not a second reload for nothing; measured alone without it only (never alone with it), on as configured, once,
to measure it. In a crowd it runs only when
measured to pay there; until then it is assumed not to (ASSUMED_CROWD_SPEEDUP: aggregate tokens/s with a draft
fell below no-draft from the second decoding slot on, llama.cpp #27342). A switch is a reload: it is made only
when what it wins over `calm` seconds is more than the reload's measured downtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ASSUMED_CROWD_SPEEDUP = 0.75  # #27342: 25-26 vs 34 tok/s at -np 4


@dataclass(frozen=True)
class Rates:
    """Tokens/s measured (aggregate over the requests decoding at once), None when not yet."""

    alone_with: float | None = None
    alone_without: float | None = None
    crowd_with: float | None = None
    crowd_without: float | None = None


@dataclass(frozen=True)
class Decision:
    draft: bool  # whether the draft should run
    switch: bool  # whether to reload for it now
    reason: str
    figures: dict[str, Any]


def decide(crowd: bool, running: bool, rates: Rates, calm_s: float, reload_s: float,
           alone_speedup: float | None = None) -> Decision:
    figures: dict[str, Any] = {"crowd": crowd, "running": running, "reload_s": round(reload_s, 3),
                               **{k: v for k, v in rates.__dict__.items() if v is not None}}
    if crowd:
        if rates.crowd_with and rates.crowd_without:
            speedup, source = rates.crowd_with / rates.crowd_without, "measured in a crowd"
        else:
            speedup, source = ASSUMED_CROWD_SPEEDUP, "assumed in a crowd until measured (llama.cpp #27342)"
    elif alone_speedup is not None:
        speedup, source = alone_speedup, "spec.alone_speedup"
    elif rates.alone_with and rates.alone_without:
        speedup, source = rates.alone_with / rates.alone_without, "measured alone"
    elif not running and rates.alone_with:
        return Decision(False, False, "alone, the draft off: kept off until a request alone has run without it "
                        "(then the two measured decide)", figures)
    elif rates.alone_without:
        return _kept(running, True, "alone, measured without the draft only: as configured, so that it is measured "
                     "with it (then the two measured decide)", figures)
    else:
        return _kept(running, True, "alone, nothing measured without the draft yet: as configured", figures)
    figures.update(speedup=round(speedup, 3), source=source)
    draft = speedup > 1
    where = "in a crowd" if crowd else "alone"
    reason = (f"{where} the draft pays: {speedup:.2f}x ({source})" if draft else
              f"{where} the draft does not pay: {speedup:.2f}x ({source})")
    if draft == running:
        return Decision(draft, False, reason, figures)
    won_s = abs(1 - (speedup if draft else 1 / speedup)) * calm_s  # decoding time a calm period wins
    figures["wins_s"] = round(won_s, 3)
    if won_s <= reload_s:
        return Decision(running, False, f"{reason}, but a switch wins {won_s:.2f}s per calm period and its "
                        f"reload costs {reload_s:.2f}s", figures)
    return Decision(draft, True, reason, figures)


def _kept(running: bool, draft: bool, reason: str, figures: dict[str, Any]) -> Decision:
    return Decision(draft, draft != running, reason, figures)
