"""What llama-server itself reported it allocated, read from its start-up lines (verbosity 4), kept per model.

Lines: `load_tensors: CPU_Mapped model buffer size = 92.10 MiB`, `llama_kv_cache: CPU KV buffer size = …`,
`sched_reserve: CPU compute buffer size = …`, `llama_context: CPU output buffer size = …`, and
`llama_context: n_ctx = 4096`. Buffers named CPU* or *_Host are host memory, the others a GPU's.
The next plan for the same model takes its weights and compute buffer from the closest measured start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from hooks.degrade.memory import Choices, MiB, Plan
from wrapper.launching.flags import wrapper_cache

log = structlog.get_logger()

_BUFFER = re.compile(r"(load_tensors|llama_kv_cache|sched_reserve|llama_context):\s+(\S+)\s+(model|KV|compute|output)"
                     r" buffer size =\s+([\d.]+) MiB")
_N_CTX = re.compile(r"llama_context: n_ctx\s+= (\d+)")
_KINDS = {"model": "weights", "KV": "kv", "compute": "compute", "output": "other"}
KEPT_RUNS = 24


def device_of(buffer: str) -> str:
    return "CPU" if buffer.startswith("CPU") or buffer.endswith("_Host") else "GPU"


@dataclass
class Measured:
    """One start's buffers: device → component → bytes, with the settings they were for."""

    settings: dict[str, Any] = field(default_factory=dict)
    devices: dict[str, dict[str, int]] = field(default_factory=dict)
    buffers: list[str] = field(default_factory=list)  # "CPU_Mapped model 92.10 MiB", as the server said
    n_ctx: int | None = None
    done: bool = False  # the compute buffer line came: the start's allocations are all in

    def feed(self, line: str) -> bool:
        """Take one server line; True when it was a buffer line."""
        if (found := _N_CTX.search(line)) is not None and self.n_ctx is None:
            self.n_ctx = int(found.group(1))
            return False
        found = _BUFFER.search(line)
        if found is None or self.done:
            return False
        _, buffer, kind, size = found.groups()
        parts = self.devices.setdefault(device_of(buffer), {})
        component = _KINDS[kind]
        parts[component] = parts.get(component, 0) + round(float(size) * MiB)
        self.buffers.append(f"{buffer} {kind} {size} MiB")
        if kind == "compute":
            self.done = True  # later compute lines belong to a draft model or mmproj: not this plan
        return True

    def component(self, name: str) -> int:
        return sum(parts.get(name, 0) for parts in self.devices.values())


def store_path(model_id: str) -> Path:
    return wrapper_cache() / "memory" / f"{model_id}.json"


def load(model_id: str) -> list[Measured]:
    try:
        data = json.loads(store_path(model_id).read_text())
        return [Measured(**run) for run in data.get("runs", [])]
    except (OSError, ValueError, TypeError):
        return []


def remember(model_id: str, measured: Measured, settings: Choices) -> None:
    """Keep this start's figures for the model (the newest per setting), written whole or not at all."""
    run = replace(measured, settings=asdict(settings))
    runs = [r for r in load(model_id) if r.settings != run.settings] + [run]
    path = store_path(model_id)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"runs": [asdict(r) for r in runs[-KEPT_RUNS:]]}, indent=1))
        temporary.replace(path)
    except OSError as exc:  # the figures are a cache: the next plan predicts instead
        log.warning("cache.unwritable", file=str(path), error=str(exc),
                    hint="set XDG_CACHE_HOME to a folder this user can write")
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


_SAME_BUILD = ("type_k", "type_v", "gpu_layers", "kv_offload", "n_ubatch", "swa_full", "n_parallel", "mmproj",
               "mmproj_offload", "draft")


def calibrated(predicted: Plan, settings: Choices, runs: list[Measured], predict: Any) -> Plan:
    """`predicted` corrected by what was measured. llama-server prints a draft model's buffers after the main
    model's, and what is measured is the main model's alone: with a draft, the main model is calibrated and the
    draft's predicted bytes are added to it."""
    if not settings.draft:
        return _calibrated(predicted, settings, runs, predict)

    def main_only(s: Choices) -> Plan:
        found: Plan = predict(replace(s, draft=None))
        return found

    alone = main_only(settings)
    out = _calibrated(alone, settings, runs, main_only)
    for device, parts in predicted.devices.items():
        for component, nbytes in parts.items():
            out.add(device, component, nbytes - alone.devices.get(device, {}).get(component, 0))
    return out


def _calibrated(predicted: Plan, settings: Choices, runs: list[Measured], predict: Any) -> Plan:
    """`predicted` with measured weights (any start with the same offload) and a measured compute buffer (the
    closest start with the same cache types and offload, moved by the predicted change of context)."""
    wanted = asdict(settings)
    out = Plan(predicted.n_ctx, {d: dict(parts) for d, parts in predicted.devices.items()}, set(predicted.measured),
               list(predicted.notes))
    same_offload = [r for r in runs if r.done and all(r.settings.get(k) == wanted[k]
                                                      for k in ("gpu_layers", "mmproj", "mmproj_offload", "draft"))]
    if same_offload:
        for device, parts in same_offload[-1].devices.items():
            if "weights" in parts:
                out.devices.setdefault(device, dict.fromkeys(("weights", "kv", "compute", "other"), 0))
                out.devices[device]["weights"] = parts["weights"]
                out.measured.add(f"{device}.weights")
    similar = [r for r in same_offload if all(r.settings.get(k) == wanted[k] for k in _SAME_BUILD)]
    if similar:
        nearest = min(similar, key=lambda r: abs(int(r.settings["n_ctx"]) - settings.n_ctx))
        then = predict(replace(settings, n_ctx=int(nearest.settings["n_ctx"])))
        for device, parts in nearest.devices.items():
            if "compute" in parts and device in out.devices:
                moved = out.devices[device]["compute"] - then.devices.get(device, {}).get("compute", 0)
                out.devices[device]["compute"] = parts["compute"] + moved
                out.measured.add(f"{device}.compute")
        if int(nearest.settings["n_ctx"]) == settings.n_ctx:
            for device, parts in nearest.devices.items():
                if "kv" in parts and device in out.devices:
                    out.devices[device]["kv"] = parts["kv"]
                    out.measured.add(f"{device}.kv")
    return out
