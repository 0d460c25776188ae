"""GET /wrapper/status: the one place its document is built."""

from __future__ import annotations

import time
from typing import Any

from wrapper.actions import HookRun
from wrapper.lifecycle import State
from wrapper.progress import PROGRESS
from wrapper.queue.gate import Gate
from wrapper.server.generation import Generation

HOOK_RUNS_SHOWN = 20


def document(state: State, generation: Generation, gate: Gate, started_at: float, ready_at: float | None,
             builtins: dict[str, Any], hook_runs: list[HookRun], last_reload: dict[str, Any] | None,
             restarts: dict[str, Any], priority: dict[str, Any], sleep: dict[str, Any]) -> dict[str, Any]:
    launch, child = generation.launch, generation.child
    now = time.monotonic()
    return {
        "state": str(state),
        "listen": launch.listen.url,
        "server": {"url": launch.url, "pid": child.pid if child and child.alive else None, "argv": launch.shown_argv},
        "model": launch.model.as_dict(),
        "uptime_s": round(now - started_at, 3),
        "ready_for_s": round(now - ready_at, 3) if ready_at else None,
        "requests": {"in_flight": gate.in_flight, "held": gate.held},
        "restarts": restarts,
        "priority": priority,
        "sleep": sleep,
        "progress": PROGRESS.snapshot(),
        "argv_changes": launch.notes,
        **builtins,
        "hooks": [run.as_dict() for run in hook_runs[-HOOK_RUNS_SHOWN:]],
        "last_reload": {k: v for k, v in last_reload.items() if k != "slots"} if last_reload else None,
    }
