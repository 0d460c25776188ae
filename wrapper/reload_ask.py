"""The one way a built-in asks for a reload. Two kinds of change, both through `Host.reload`:

- `asks` (by the type of each, declared in hooks/asks.py): what the built-ins' fits should make of the next
  generation (a rung, a budget, a projector); the config stays as it is and the fits are the whole change;
- `body`: what POST /wrapper/reload takes (`n_ctx`, `cache_type_k`, `args`, ...): the config changes for good.

A reload that runs already is waited for (up to `wait`, by default `reload.hold_timeout`), then this one runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from wrapper.configuration.reload_plan import Refusal, ReloadRefused
from wrapper.launching.launch import Asks
from wrapper.server.generation import Host

BUSY_RETRY_S = 0.2


@dataclass(frozen=True)
class Reloaded:
    """The reload ran and the new generation serves: its answer (downtime, what was restored, ...)."""

    answer: dict[str, Any]


@dataclass(frozen=True)
class RolledBack:
    """The reload ran, but the new generation did not come up: what ran before serves again; why."""

    reason: str
    answer: dict[str, Any]


@dataclass(frozen=True)
class Unchanged:
    """Nothing had to change: what runs is what was asked for."""

    reason: str


@dataclass(frozen=True)
class NotReloaded:
    """Refused (not ready, a wrong value) or another reload still ran at the deadline; nothing changed."""

    reason: str


Asked = Reloaded | RolledBack | Unchanged | NotReloaded


async def ask_reload(host: Host, why: str, asks: Asks | None = None,
                     body: Mapping[str, Any] | None = None, wait: float | None = None, cut: bool = True) -> Asked:
    """`cut` False: a move made for another's sake (a pool member giving memory) never cuts an answer in flight;
    it is RolledBack when they do not finish within reload.drain_timeout."""
    deadline = time.monotonic() + (wait if wait is not None else host.current.config.reload_hold_timeout)
    while True:
        try:
            answer = await host.reload(dict(body or {}), why, asks, cut)
            if not answer.get("success"):
                return RolledBack(str(answer.get("message") or "the new llama-server did not come up"), answer)
            return Reloaded(answer)
        except ReloadRefused as exc:
            if exc.reason is Refusal.NOTHING_TO_CHANGE:
                return Unchanged(str(exc))
            if exc.reason is not Refusal.BUSY or time.monotonic() > deadline:
                return NotReloaded(str(exc))
        await asyncio.sleep(BUSY_RETRY_S)  # another reload runs: wait for it, then ours
