"""What a reload costs: downtime overlapped vs sequential, a held request's added latency, KV conversion speed,
all side by side with a cold prefill of the same conversation on the new settings.

One wrapper per overlap policy serves Gemma 3 270M (-c 4096, f16) with a conversation of about 3,000 tokens,
then reloads to q8_0 K/V at 16k (the slot file is converted and restored). During the reload one request is
held and timed. Then the same conversation is prefilled cold on the new settings. Conversion throughput is
measured on the saved f16 file for q8_0 and q4_0. Run with `make bench` (it sets LLAMA_SERVER).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hooks.kvfile.convert import convert, target_rotation
from tests import models
from tests.helpers import Wrapper, http, wait_for

TOKEN = "bench"
CONFIG = """
slots: {{dir: {dir}}}
reload: {{overlap: {overlap}}}
hooks:
  on_startup: [{{builtin: slots.restore, timeout: 120s}}]
  on_will_stop: [{{builtin: slots.save, timeout: 120s}}]
"""
TEXT = ("The lighthouse keeper counted the ships that passed the northern cape each night, writing their names "
        "in a ledger bound with blue thread. ")
CHANGE = {"n_ctx": 32768, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}  # 16k per slot


def timed(method: str, url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[float, int, Any]:
    started = time.perf_counter()
    status, _, raw = http(method, url, body, timeout=3600, headers=headers)
    return time.perf_counter() - started, status, json.loads(raw)


def one_policy(tmp: Path, argv: list[str], overlap: str, history: str) -> dict[str, Any]:
    wrapper = Wrapper(tmp, argv, CONFIG.format(dir=tmp / "slots", overlap=overlap),
                      env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN})
    try:
        wrapper.wait_ready(300)
        _, status, first = timed("POST", f"{wrapper.url}/completion",
                                 {"prompt": history, "n_predict": 1, "id_slot": 0})
        assert status == 200, first
        small = {"prompt": "Hi", "n_predict": 1, "id_slot": 1}  # slot 1: slot 0 holds the conversation
        baseline = min(timed("POST", f"{wrapper.url}/completion", small)[0] for _ in range(3))
        answers: list[Any] = []
        reloading = threading.Thread(target=lambda: answers.append(timed(
            "POST", f"{wrapper.url}/wrapper/reload", CHANGE, {"Authorization": f"Bearer {TOKEN}"})))
        reloading.start()
        wait_for(lambda: wrapper.status()["state"] == "reloading", 60, "the reload to begin")
        held_s, held_status, _ = timed("POST", f"{wrapper.url}/completion", small)
        reloading.join(600)
        _, status, answer = answers[0]
        assert status == 200 and answer["success"], answer
        server = wrapper.status()["server"]["url"]
        http("POST", f"{server}/slots/0?action=erase")  # the same conversation, cold, on the new settings
        cold_s, _, cold = timed("POST", f"{server}/completion", {"prompt": history, "n_predict": 1, "id_slot": 0})
        assert cold["timings"]["cache_n"] == 0
        slot = next(entry for entry in answer["slots"] if entry["slot"] == 0)
        return {"downtime_ms": answer["downtime_ms"], "held_s": held_s, "held_status": held_status,
                "baseline_s": baseline, "cold_s": cold_s, "tokens": first["tokens_evaluated"],
                "conversion": slot.get("conversion"), "outcome": slot["outcome"]}
    finally:
        wrapper.stop(300)
        wrapper.kill()


def conversion_speed(tmp: Path, facts: dict[str, Any]) -> dict[str, float]:
    folder = next((tmp / "slots").iterdir())
    source = max(folder.glob("conv-*-*.bin"), key=lambda p: p.stat().st_mtime)  # the saved states
    speeds = {}
    for kind in ("q8_0", "q4_0"):
        # the file may already be q8_0 after the reload: convert from a fresh f16 copy made by converting back
        f16 = tmp / "f16.bin"
        convert(source, f16, "f16", "f16", 0, 0)
        rot_k = target_rotation(kind, facts.get("head_dim_k"), True, False)
        rot_v = target_rotation(kind, facts.get("head_dim_v"), False, False)
        done = convert(f16, tmp / f"{kind}.bin", kind, kind, rot_k, rot_v)
        speeds[kind] = done.mb_per_s
        speeds[f"{kind}_mb"] = done.bytes_in / 1e6
    return speeds


def main() -> None:
    from wrapper.launching.gguf_meta import architecture_facts, read_metadata

    server, model = models.llama_server(), models.gemma()
    tokens = int(os.environ.get("TOKENS", "3000"))
    history = TEXT * (tokens // 27)
    argv = [server, "-m", model, "-c", "8192", "-np", "2"]  # 4k per slot
    results = {}
    for overlap in ("always", "never"):
        with tempfile.TemporaryDirectory() as name:
            results[overlap] = one_policy(Path(name), argv, overlap, history)
            if overlap == "always":
                speeds = conversion_speed(Path(name), architecture_facts(read_metadata(model)))
        print(f"  overlap {overlap}: done", file=sys.stderr)
    o, s = results["always"], results["never"]
    print(f"\nreload cost, {Path(model).name}, {os.cpu_count()} CPUs; f16 4k -> q8_0 16k, "
          f"{o['tokens']}-token conversation\n")
    print("| measure | overlapped | sequential |")
    print("|---|---:|---:|")
    print(f"| downtime, gate closed -> open (ms) | {o['downtime_ms']:.0f} | {s['downtime_ms']:.0f} |")
    print(f"| a small request held during the reload (s, status) | {o['held_s']:.2f} ({o['held_status']}) | "
          f"{s['held_s']:.2f} ({s['held_status']}) |")
    print(f"| the same request when ready (s) | {o['baseline_s']:.3f} | {s['baseline_s']:.3f} |")
    print(f"| cold prefill of the conversation on the new settings (s) | {o['cold_s']:.2f} | {s['cold_s']:.2f} |")
    print(f"| slot outcome, conversion | {o['outcome']}, {o['conversion']} | {s['outcome']}, "
          f"{s['conversion']} |")
    print(f"\nconversion f16 -> q8_0: {speeds['q8_0']:.0f} MB/s, f16 -> q4_0: {speeds['q4_0']:.0f} MB/s "
          f"({speeds['q8_0_mb']:.1f} MB of f16)")
    print(f"reload (overlapped) / cold prefill: {o['downtime_ms'] / 1000 / o['cold_s']:.2f}")
    print(f"overlap/sequential downtime ratio: {o['downtime_ms'] / s['downtime_ms']:.2f}")


if __name__ == "__main__":
    main()
