"""What sleep costs the request that wakes the model, against what the ways out today cost it.

One conversation of about HISTORY tokens, then its next turn (max_tokens 1: the time to the answer is the time to
the first token), measured three ways side by side in one run:
  wake   a wrapper with `sleep:` and the slot built-ins, asleep (POST /wrapper/sleep): the next turn wakes it, the
         slot is restored, the turn reuses the conversation — the wait is the wake (start + restore) and a short
         prefill
  cold   what llama-swap's `ttl` or llama-server's `--sleep-idle-seconds` leave: a start without saved slots
         (measured from the process start, as llama-swap starts one) and the whole conversation prefilled again
  awake  the same turn on a server that never slept (the floor)

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_sleep.py [--model gemma]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import Wrapper, chat, http

TOKEN = "bench-sleep"
CONFIG = """
slots: {{dir: {dir}}}
sleep: {{after: off}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
HISTORY = 4000


def conversation() -> list[dict[str, str]]:
    return [{"role": "user", "content": "Remember this ledger. " + STORY * (HISTORY // 18)}]


def next_turn(first: list[dict[str, str]], answer: dict[str, Any]) -> list[dict[str, str]]:
    return [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Who kept the ledger?"}]


def timed(url: str, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    began = time.perf_counter()
    answer = chat(url, messages, max_tokens=1)
    return time.perf_counter() - began, answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["demo", "gemma"], default="demo")
    options = parser.parse_args()
    server = models.llama_server()
    model = models.gemma() if options.model == "gemma" else models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", "1"]
    first = conversation()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        wrapper = Wrapper(tmp, argv, CONFIG.format(dir=tmp / "slots"), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN})
        try:
            wrapper.wait_ready(300)
            answer = chat(wrapper.url, first, max_tokens=16)
            turn = next_turn(first, answer)
            awake_s, _ = timed(wrapper.url, turn)
            chat(wrapper.url, first, max_tokens=16)  # the slot holds the first turn again, as before the sleep
            status, _, raw = http("POST", f"{wrapper.url}/wrapper/sleep", headers={"Authorization": f"Bearer {TOKEN}"},
                                  timeout=120)
            assert status == 200, raw
            wake_s, woke = timed(wrapper.url, turn)
            wake_only = wrapper.status()["sleep"]["last_wake_s"]
        finally:
            wrapper.stop(120)
            wrapper.kill()
        began = time.perf_counter()
        cold = Wrapper(tmp, argv)  # nothing saved: as after llama-swap's ttl or --sleep-idle-seconds
        try:
            cold.wait_ready(300)
            cold_s, prefilled = timed(cold.url, turn)
            cold_total = time.perf_counter() - began
        finally:
            cold.stop(120)
            cold.kill()
    tokens = woke["usage"]["prompt_tokens"]
    print(f"the next turn of a {tokens}-token conversation ({Path(model).name}, -np 1), time to its answer:")
    print(f"  awake (never slept)            {awake_s:7.3f} s")
    print(f"  wake from sleep                {wake_s:7.3f} s  (the wake {wake_only:.3f} s: start + restore; "
          f"{woke['timings']['cache_n']} tokens reused, {woke['timings']['prompt_n']} prefilled)")
    print(f"  cold start + prefill           {cold_total:7.3f} s  (the request {cold_s:.3f} s, "
          f"{prefilled['timings']['prompt_n']} tokens prefilled)")
    print(f"  wake / cold: x{wake_s / cold_total:.2f}    wake / awake: x{wake_s / awake_s:.1f}")


if __name__ == "__main__":
    main()
