"""What slot persistence saves: the next turn after a restart, restored vs cold, at several history sizes.

For each history size: a conversation is prefilled, the wrapper is stopped (slots.save) and started again
(slots.restore), and the next turn is timed; then the same turn is timed on a cold start. Also prints the
save and restore times against the file size, and the wrapper's own share of the restore time.
Run with `make bench` (it sets LLAMA_SERVER). SIZES=1000,4000 narrows the run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import models
from tests.helpers import Wrapper, http

SIZES = [int(s) for s in os.environ.get("SIZES", "1000,4000,8000,16000").split(",")]
CONFIG = """
slots: {{dir: {dir}}}
hooks:
  on_startup: [{{builtin: slots.restore, timeout: 120s}}]
  on_will_stop: [{{builtin: slots.save, timeout: 120s}}]
"""
TEXT = ("The lighthouse keeper counted the ships that passed the northern cape each night, writing their names "
        "in a ledger bound with blue thread. ")
TOKENS_PER_SENTENCE = 27  # Gemma 3 tokenizer, measured on TEXT


def complete(url: str, prompt: str) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    status, _, raw = http("POST", f"{url}/completion",
                          {"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": True}, timeout=3600)
    assert status == 200, raw
    return time.perf_counter() - started, json.loads(raw)


def run_once(tmp: Path, argv: list[str], config: str, prompt: str) -> tuple[float, dict[str, Any], Wrapper]:
    wrapper = Wrapper(tmp, argv, config, extra=["--log-level", "info"])
    wrapper.wait_ready(300)
    try:
        seconds, answer = complete(wrapper.url, prompt)
    finally:
        wrapper.stop(300)
        wrapper.kill()
    return seconds, answer, wrapper


def main() -> None:
    server, model = models.llama_server(), models.gemma()
    rows = []
    for size in SIZES:
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(name)
            slots = tmp / "slots"
            config = CONFIG.format(dir=slots)
            argv = [server, "-m", model, "-c", str(size + 1024), "-np", "1"]
            history = TEXT * (size // TOKENS_PER_SENTENCE)
            follow = history + " The next night, a ship with black sails"
            _, first, saver = run_once(tmp, argv, config, history)
            saved = saver.events("slots.saved")[0]
            warm_s, warm, restorer = run_once(tmp, argv, config, follow)
            restored = restorer.events("slots.restored")[0]
            restore_hook = next(e for e in restorer.events("hook.run") if e["action"] == "slots.restore")
            shutil.rmtree(slots)
            cold_s, _, _ = run_once(tmp, argv, config, follow)
            rows.append({
                "history": first["tokens_evaluated"], "cold_s": cold_s, "warm_s": warm_s,
                "cache_n": warm["timings"]["cache_n"], "mb": saved["bytes"] / 1e6,
                "save_ms": saved["server_ms"], "save_total_ms": saved["total_ms"],
                "restore_ms": restored["server_ms"], "restore_total_ms": restored["total_ms"],
                "restore_hook_ms": restore_hook["duration_ms"],
            })
            print(f"  {size}: done", file=sys.stderr)
    print(f"\nslot persistence, {Path(model).name}, 2-core CPU; next turn = history + 10 tokens, n_predict 1\n")
    print("| history tokens | cold turn (s) | restored turn (s) | speed-up | cache_n | file (MB) | save ms "
          "(server / wrapper) | restore ms (server / wrapper / whole hook) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['history']} | {r['cold_s']:.2f} | {r['warm_s']:.3f} | {r['cold_s'] / r['warm_s']:.0f}x | "
              f"{r['cache_n']} | {r['mb']:.1f} | {r['save_ms']:.0f} / {r['save_total_ms']:.0f} | "
              f"{r['restore_ms']:.0f} / {r['restore_total_ms']:.0f} / {r['restore_hook_ms']:.0f} |")


if __name__ == "__main__":
    main()
