"""What going on exactly costs after a crash: a greedy `write_file` call cut by its budget (SmolLM2 135M, Llama 3.1's
chat template from llama.cpp's tree, examples/chat.yaml as it is, -np 1; tests/integration/test_crash.py's call),
llama-server SIGKILLed when the client has half of the call's argument deltas. One wrapper generates the answer
again from the start (`watchdog.replay_tokens`, the default: a decode step per token again), the other goes on from
the call's arguments, read in one batch (`replay_tokens: 0`); their kills are interleaved, so that a busy machine
slows both alike. Printed: the median time from the kill to the answer's end, its ratio, how many of the answers
gave the uncut call's arguments exactly, how many went on from the arguments, and how many of those prefills were
the model's own tokens (their count what llama-server counted).

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_replay.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import chat_yaml, running
from tests.killing import Events, streamed

ROUNDS = 5
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
BODY = {"messages": [{"role": "user", "content": "Read the file README.md please."}], "tools": [WRITE_FILE],
        "tool_choice": "required", "temperature": 0, "max_tokens": 77}  # test_crash's call cut by its budget
WAYS = {"from the start": "", "from the arguments": "watchdog: {replay_tokens: 0, restarts: 100, window: 10m}\n"}


def pieces(events: Events) -> list[str]:
    """The argument pieces of the call's deltas, in order."""
    return [c["function"]["arguments"] for e in events if e.get("choices")
            for c in (e["choices"][0].get("delta") or {}).get("tool_calls") or []
            if (c.get("function") or {}).get("arguments")]


def killed_at(url_wrapper: Any, k: int) -> tuple[float, str]:
    """The seconds from the kill after the k-th argument delta to the answer's end, and the arguments it gave."""
    killed: list[float] = []

    def at(events: Events) -> bool:
        if len(pieces(events)) >= k:
            killed.append(time.perf_counter())
            return True
        return False

    events = streamed(url_wrapper, BODY, at)
    return time.perf_counter() - killed[0], "".join(pieces(events))


def main() -> None:
    server, model = models.llama_server(), models.demo()
    argv = [server, "-m", model, "-c", "4096", "-np", "1", "--jinja", "--chat-template-file",
            models.template(server, "meta-llama-Llama-3.1-8B-Instruct")]
    restarts = "watchdog: {restarts: 100, window: 10m}\n"
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for way in WAYS:
            (tmp / way.replace(" ", "-")).mkdir()
        configs = {way: chat_yaml(tmp / way.replace(" ", "-"), extra or restarts) for way, extra in WAYS.items()}
        with running(tmp / "from-the-start", argv, configs["from the start"]) as again, \
                running(tmp / "from-the-arguments", argv, configs["from the arguments"]) as batch:
            wrappers = {"from the start": again, "from the arguments": batch}
            streamed(again, BODY)  # the prompt in the slot, as for each killed run after it (llama-server then
            uncut = "".join(pieces(streamed(again, BODY)))  # reads its last token again, alone)
            streamed(batch, BODY)
            k = max(1, len(pieces(streamed(again, BODY))) // 2)
            took: dict[str, list[float]] = {way: [] for way in WAYS}
            exact = dict.fromkeys(WAYS, 0)
            for _ in range(ROUNDS):
                for way, wrapper in wrappers.items():
                    seconds, arguments = killed_at(wrapper, k)
                    took[way].append(seconds)
                    exact[way] += arguments == uncut
            went_on = {way: len(wrapper.events("wrapper.call_goes_on")) for way, wrapper in wrappers.items()}
            matched = {way: sum(1 for e in wrapper.events("wrapper.call_goes_on") if e.get("as_generated"))
                       for way, wrapper in wrappers.items()}
    base = statistics.median(took["from the arguments"])
    print(f"model {Path(model).name}, Llama 3.1's template, a call of {len(uncut)} characters killed after {k} "
          f"argument deltas, {ROUNDS} kills each")
    print(f"{'goes on':<20} {'kill to end s':>14} {'x arguments':>12} {'uncut call':>11} {'from arguments':>15} "
          f"{'as generated':>13}")
    for way in WAYS:
        median = statistics.median(took[way])
        print(f"{way:<20} {median:>14.2f} {median / base:>12.2f} {exact[way]:>8} of {ROUNDS} {went_on[way]:>15} "
              f"{matched[way]:>13}")


if __name__ == "__main__":
    main()
