"""The gauges a router in front reads from /metrics (`router:`): requests waiting for a slot, requests in a slot,
the KV cache's use. Named as the router's scorer reads them (the Gateway API Inference Extension's endpoint
picker reads vLLM's names by default), so it scores llama-server hosts as it scores vLLM ones. Written by hand,
not registered: their names come from the config, which a reload may change."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from wrapper.configuration.sections import RouterGaugeSettings


@dataclass(frozen=True)
class Load:
    waiting: int  # in the slots' queue, or held by the gate while the server starts or reloads
    running: int  # in a slot
    held: int | None  # the tokens the slots hold (None: no built-in tracks them)
    context: int | None  # the context llama-server runs (every slot's added up, or the shared one)

    def kv_usage(self) -> float | None:
        if self.held is None or not self.context:
            return None
        return min(1.0, max(0.0, self.held / self.context))


def loads(load: Load, now: float) -> dict[str, Any]:
    """The load in the shape SGLang's workers answer `GET /v1/loads` with, which SGLang's model gateway (SMG)
    polls on a worker it cannot identify otherwise: one data-parallel rank, its requests in a slot and waiting, the
    tokens its KV holds over what it may hold (0 when no built-in tracks them)."""
    used, total = load.held or 0, load.context or 0
    return {"timestamp": datetime.fromtimestamp(now, UTC).isoformat(), "dp_rank_count": 1,  # SMG reads a text: a
            # number there makes it take the answer for none, and never ask again
            "loads": [{"dp_rank": 0, "num_running_reqs": load.running, "num_waiting_reqs": load.waiting,
                       "num_total_reqs": load.running + load.waiting,
                       "num_used_tokens": used, "max_total_num_tokens": total,
                       "token_usage": round(load.kv_usage() or 0.0, 4)}]}


def exposition(names: RouterGaugeSettings, load: Load) -> bytes:
    """The gauges in the Prometheus text format (0.0.4); a name set to '' leaves its gauge out, as does a KV use
    that is not known."""
    kv = load.kv_usage()
    gauges = ((names.waiting, "Requests waiting for a slot (queued, or held while llama-server starts or reloads)",
               float(load.waiting)),
              (names.running, "Requests in a slot of llama-server", float(load.running)),
              (names.kv_usage, "The KV cache's use, from 0 to 1: the tokens the slots hold over the context", kv))
    lines = []
    for name, doc, value in gauges:
        if name and value is not None:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", f"{name} {value!r}"]
    return ("\n".join(lines) + "\n").encode() if lines else b""
