"""The next turn of a long conversation: what the wrapper with the conversation cache adds to it, at 2k, 8k and 16k
tokens of history, measured side by side with llama-server direct in one run.

One llama-server (Gemma 3 270M, -np 1) behind a wrapper with the slot built-ins and the conversation cache on. For
each length one conversation grows turn by turn: every measured request is the next turn of the conversation its
slot holds (an answer of ~20 tokens and a question of ~20, so ~45 new tokens to prefill), sent alternately through
the wrapper and direct (pinned to slot 0 as the wrapper pins it), so that both prefill the same and noise hits
both alike. It prints the median of each and their ratio per length, and the time outside the server's own
prefill: a cost that grows with the history shows as an `added` that grows down the table.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_long_turn.py [--turns N] [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import Wrapper, http

CONFIG = """
slots: {{dir: {dir}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
LENGTHS = (2048, 8192, 16384)
TEXT = ("the keeper of the northern lighthouse wrote the name of every ship that passed into a ledger and "
        "counted the gulls on the rocks while the storm gathered over the grey water")
WORDS = TEXT.split()


def paragraph(index: int, words: int) -> str:
    return " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(words)) + f" ({index})."


def history(url: str, tokens: int) -> list[dict[str, str]]:
    """Messages whose template comes to about `tokens` tokens (as the server counts them)."""
    def pair(index: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": paragraph(index, 90)},
                {"role": "assistant", "content": paragraph(index + 1, 90)}]

    def counted(messages: list[dict[str, str]]) -> int:
        status, _, raw = http("POST", f"{url}/apply-template", {"messages": messages})
        assert status == 200, raw[:200]
        status, _, raw = http("POST", f"{url}/tokenize", {"content": json.loads(raw)["prompt"]})
        return len(json.loads(raw)["tokens"])

    per_pair = counted(pair(0) + pair(2)) - counted(pair(0))
    messages = [m for index in range(0, 2 * max(1, tokens // per_pair), 2) for m in pair(index)]
    while counted(messages) < tokens:
        messages += pair(len(messages))
    return messages


def turn(url: str, messages: list[dict[str, str]], pinned: bool = False) -> tuple[float, float, int, int]:
    """(seconds to the answer of one token, of them the server's prefill, tokens reused, tokens prefilled).
    `pinned`: name slot 0, as the wrapper does (llama-server treats a request without `id_slot` otherwise: its
    prompt-cache lookup costs tens of milliseconds at 16k, which would flatter the wrapper)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
    if pinned:
        body["id_slot"] = 0
    began = time.perf_counter()
    status, _, raw = http("POST", f"{url}/v1/chat/completions", body, timeout=900)
    seconds = time.perf_counter() - began
    assert status == 200, raw[:300]
    timings = json.loads(raw)["timings"]
    return seconds, float(timings["prompt_ms"]) / 1e3, int(timings.get("cache_n") or 0), int(timings["prompt_n"])


@dataclass
class Row:
    length: int
    wrapped: float  # medians, seconds
    direct: float
    wrapped_outside: float  # outside the server's prefill: templating, tokenizing, HTTP, the wrapper
    direct_outside: float
    reused: int
    prefilled: int


def measure(wrapped: str, direct: str, length: int, turns: int) -> Row:
    messages = [*history(direct, length), {"role": "user", "content": "What did the keeper count?"}]
    turn(wrapped, messages)  # the slot holds it now: each turn after this one is a next turn
    times: dict[str, list[float]] = {wrapped: [], direct: []}
    outside: dict[str, list[float]] = {wrapped: [], direct: []}
    reused = prefilled = 0
    for index in range(2 * turns):
        base = (wrapped, direct)[index % 2]
        messages += [{"role": "assistant", "content": paragraph(index, 18)},
                     {"role": "user", "content": paragraph(index + 3, 16) + " What now?"}]
        seconds, prefill_s, reused, prefilled = turn(base, messages, pinned=base == direct)
        times[base].append(seconds)
        outside[base].append(seconds - prefill_s)
        time.sleep(0.2)  # a person reads the answer; an agent runs its tool
    median = statistics.median
    return Row(length, median(times[wrapped]), median(times[direct]), median(outside[wrapped]),
               median(outside[direct]), reused, prefilled)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=8, help="measured turns per path and length")
    parser.add_argument("--model", choices=("gemma", "smollm2"), default="gemma")
    parser.add_argument("--lengths", type=lambda text: [int(n) for n in text.split(",")], default=LENGTHS,
                        help="history lengths in tokens, comma-separated (default 2048,8192,16384)")
    options = parser.parse_args()
    model = models.gemma() if options.model == "gemma" else models.demo()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "hooks.yaml"
        config.write_text(CONFIG.format(dir=Path(tmp) / "slots"))
        argv = [models.llama_server(), "-m", model, "-c", str(max(options.lengths) + 4096), "-np", "1"]
        wrapper = Wrapper(Path(tmp), argv, config=config.read_text(), extra=["--log-level", "warning"])
        try:
            wrapper.wait_ready(180)
            direct = wrapper.status()["server"]["url"]
            rows = [measure(wrapper.url, direct, length, options.turns) for length in options.lengths]
            continued = wrapper.status()["slots"]["conversations"].get("continued")
        finally:
            wrapper.stop()
            wrapper.kill()
    print(f"\nthe next turn of a long conversation, {Path(model).name}, -np 1, {os.cpu_count()} CPUs; wrapped (slots "
          f"and the conversation cache) and direct interleaved, {options.turns} turns each, median\n")
    print(f"| {'history (tokens)':>16} | {'wrapped (ms)':>12} | {'direct (ms)':>11} | {'wrapped/direct':>14} | "
          f"{'outside prefill: wrapped / direct (ms)':>38} | {'added (ms)':>10} | {'reused / prefilled (last)':>25} |")
    print(f"|{'-' * 18}|{'-' * 14}|{'-' * 13}|{'-' * 16}|{'-' * 40}|{'-' * 12}|{'-' * 27}|")
    for r in rows:
        outside = f"{r.wrapped_outside * 1e3:.1f} / {r.direct_outside * 1e3:.1f}"
        added = (r.wrapped_outside - r.direct_outside) * 1e3
        print(f"| {r.length:>16} | {r.wrapped * 1e3:>12.1f} | {r.direct * 1e3:>11.1f} | "
              f"{r.wrapped / r.direct:>14.3f} | {outside:>38} | {added:>+10.1f} | "
              f"{f'{r.reused} / {r.prefilled}':>25} |")
    print("\n`outside prefill`: the time to the answer less the server's own prompt_ms (its templating, tokenizing and "
          "HTTP, and the wrapper's part); `added` is their difference: what the wrapper adds, free of the prefill's "
          "noise.")
    print(f"\nrequests that went on in the slot holding their conversation (no template, tokens or lookup): "
          f"{continued}")


if __name__ == "__main__":
    main()
