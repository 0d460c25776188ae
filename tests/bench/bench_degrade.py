"""What the degradation ladder buys and costs.

Capacity: under one memory budget, the largest context a static configuration (the command line as given,
f16 K/V) fits against the ladder's last rung, from the planner (checked against the server's own buffer lines
in tests/integration/test_degrade.py), for the H200 table's 1.2B model, Gemma 3 270M and the demo model.

Wait: Gemma 3 270M under a budget where f16 holds about 5k tokens; a conversation of ~4k tokens, then a turn of
~8k that overflows. The client's wait for that turn (growth: hold, save, reload to q8_0, convert, restore,
the prefill of the new part) side by side with a cold prefill of the same prompt on a fresh server started at
the grown settings. Run with `make bench` (it sets LLAMA_SERVER).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hooks.degrade.memory import Choices, MiB, ModelShape, largest_ctx, plan, read_shape
from tests import models
from tests.helpers import Wrapper, http
from tests.unit.degrade.test_memory import h200_model

CONFIG = """
slots: {{dir: {dir}}}
degrade: {{budget: {budget}, headroom: 256}}
hooks:
  on_startup: [{{builtin: slots.restore, timeout: 120s}}]
  on_will_stop: [{{builtin: slots.save, timeout: 120s}}]
"""
STORY = "The lighthouse keeper counted the ships that passed the northern cape each night. "


def capacity(name: str, shape: ModelShape, budget: int, gpu_layers: int, swa_full: bool) -> dict[str, Any]:
    base = Choices(n_ctx=0, gpu_layers=gpu_layers, swa_full=swa_full)
    ceiling = 1 << 20  # the budget decides, not the training context
    static = largest_ctx(shape, base, budget, ceiling)
    q8 = largest_ctx(shape, replace(base, type_k="q8_0", type_v="q8_0"), budget, ceiling)
    q4 = largest_ctx(shape, replace(base, type_k="q4_0", type_v="q4_0"), budget, ceiling)
    return {"model": name, "budget_mib": round(budget / MiB), "static": static, "q8_0": q8, "q4_0": q4,
            "gain": q4 / static - 1 if static else None}


def timed(method: str, url: str, body: Any) -> tuple[float, int, Any]:
    started = time.perf_counter()
    status, _, raw = http(method, url, body, timeout=3600)
    return time.perf_counter() - started, status, json.loads(raw)


def growth_wait(tmp: Path, server: str, gemma: str) -> dict[str, Any]:
    shape = read_shape(gemma)
    budget = plan(shape, Choices(n_ctx=15104, type_k="q4_0", type_v="q4_0", swa_full=True)).total() + MiB
    wrapper = Wrapper(tmp, [server, "-m", gemma, "-np", "1"], CONFIG.format(dir=tmp / "slots", budget=budget))
    try:
        wrapper.wait_ready(300)
        history = STORY * 250  # ~4k tokens: f16 holds it
        _, status, first = timed("POST", f"{wrapper.url}/completion", {"prompt": history, "n_predict": 4})
        assert status == 200, first
        grown = history + first["content"] + STORY * 250  # ~8k: past f16's context
        wait_s, status, answer = timed("POST", f"{wrapper.url}/completion", {"prompt": grown, "n_predict": 4})
        assert status == 200, answer
        state = wrapper.status()["degrade"]
        step = state["steps"][-1]
        argv = wrapper.status()["server"]["argv"]
    finally:
        wrapper.stop()
    cold = Wrapper(tmp, [server, "-m", gemma, "-np", "1", "-c", str(state["n_ctx"]), "-ctk", "q8_0", "-ctv", "q8_0",
                         "--swa-full"])
    try:
        cold.wait_ready(300)
        cold_s, status, cold_answer = timed("POST", f"{cold.url}/completion", {"prompt": grown, "n_predict": 4})
        assert status == 200, cold_answer
    finally:
        cold.stop()
    return {"tokens": answer["tokens_evaluated"], "reused": answer["timings"]["cache_n"], "wait_s": wait_s,
            "reload_downtime_ms": step["downtime_ms"], "rung": state["rung"], "cold_s": cold_s, "argv": argv}


def main() -> None:
    server, gemma, demo = models.llama_server(), models.gemma(), models.demo()
    rows = [capacity("1.2B f16 (H200 table), 8 GiB GPU", h200_model(), 8 << 30, 99, False),
            capacity("Gemma 3 270M, 1 GiB CPU, --swa-full", read_shape(gemma), 1 << 30, 0, True),
            capacity("SmolLM2 135M (demo), 512 MiB CPU", read_shape(demo), 512 << 20, 0, False)]
    print(f"{'model, budget':<42}{'static f16':>12}{'q8_0':>10}{'q4_0':>10}{'gain':>8}")
    for row in rows:
        print(f"{row['model']:<42}{row['static']:>12,}{row['q8_0']:>10,}{row['q4_0']:>10,}{row['gain'] * 100:>7.0f}%")
    with tempfile.TemporaryDirectory() as tmp:
        wait = growth_wait(Path(tmp), server, gemma)
    print(f"\ngrowth step (Gemma, {wait['tokens']:,}-token prompt, to {wait['rung']}): the client waited "
          f"{wait['wait_s']:.2f} s (reload downtime {wait['reload_downtime_ms']:.0f} ms, {wait['reused']:,} tokens "
          f"reused); a cold prefill of the same prompt on those settings: {wait['cold_s']:.2f} s")
    gains = ", ".join(f"{row['gain'] * 100:+.0f}%" for row in rows)
    print(f"capacity gain of the ladder under the same budget: {gains}")
    print(f"growth wait / cold prefill: {wait['wait_s'] / wait['cold_s']:.2f}")


if __name__ == "__main__":
    main()
