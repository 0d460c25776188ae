"""What keeping a busy agent's conversation costs the others, side by side with checkpoints only when quiet.

Two runs of one workload on `-np 2` with examples/chat.yaml (slots, the conversation cache): an agent's loop sends
turns back to back (each adds a ~1.2k-token file to its conversation: every answer grows it past
`cache.checkpoint_tokens`), while a person's stream decodes in the other slot the whole time. One run with the
default `cache.checkpoint_share` (0.05: checkpoints right after an answer, within 5 % of the server's time), one with
0 (only after 2 s of quiet, which the loop never leaves). Printed per run: the person's decode rate and its longest
gap between tokens, the checkpoints taken, what their saves held the server's loop (ms per MB written by the server,
and as a share of the busy time), and what a crash at the end would prefill again (the unkept tokens); then the
ratios, and the pause a SIGKILL mid-turn costs the agent (the kill to its next token) in each run.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_checkpoints.py [--turns 4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import Wrapper, chat_yaml, http, wait_for

FILE = " ".join(f"src/mill/stone_{i}.py:{i}: warning: the stone {i} is heavier than the river allows." for i in
                range(60))  # ~1.2k tokens: each turn reads one more such file


class Person(threading.Thread):
    """Streams from slot 1 until stopped, one long answer after another: every token's arrival time."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.arrivals: list[float] = []

    def run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        while not self.stop.is_set():
            connection = HTTPConnection(host, int(port), timeout=600)
            body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
                    "max_tokens": 150, "temperature": 0, "stream": True, "ignore_eos": True}
            connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            for raw in connection.getresponse():
                if raw.startswith(b"data:") and b'"content"' in raw:
                    self.arrivals.append(time.perf_counter())
                if self.stop.is_set():
                    break
            connection.close()


def agent_turns(url: str, turns: int) -> tuple[list[dict[str, Any]], float]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    began = time.perf_counter()
    for turn in range(turns):
        messages.append({"role": "user", "content": f"File {turn}:\n{FILE}\nWhat is wrong in it?"})
        status, _, raw = http("POST", f"{url}/v1/chat/completions",
                              {"messages": messages, "max_tokens": 24, "temperature": 0}, timeout=600)
        assert status == 200, raw[:300]
        messages.append({"role": "assistant", "content": json.loads(raw)["choices"][0]["message"]["content"]})
    return messages, time.perf_counter() - began


def killed_mid_turn(wrapper: Wrapper, messages: list[dict[str, Any]]) -> float:
    """The agent's next turn streamed, llama-server SIGKILLed at its 10th token: seconds to the 11th."""
    host, port = wrapper.url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    body = {"messages": [*messages, {"role": "user", "content": "Go on."}], "max_tokens": 40, "temperature": 0,
            "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    pid = int(wrapper.status()["server"]["pid"])
    arrivals: list[float] = []
    killed = 0.0
    for raw in connection.getresponse():
        if raw.startswith(b"data:") and b'"content"' in raw:
            arrivals.append(time.perf_counter())
            if len(arrivals) == 10:
                killed = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
    connection.close()
    return arrivals[10] - killed if len(arrivals) > 10 else float("nan")


def one_run(server: str, model: str, share: float, turns: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        config = chat_yaml(tmp, f"cache:\n  checkpoint_share: {share}\n")
        wrapper = Wrapper(tmp, [server, "-m", model, "-c", "8192", "-np", "2"], config,
                          extra=["--log-level", "info"])
        try:
            wrapper.wait_ready(300)
            person = Person(wrapper.url)
            person.start()
            wait_for(lambda: len(person.arrivals) > 5, 120, "the person's stream")
            messages, took = agent_turns(wrapper.url, turns)
            person.stop.set()
            person.join(120)
            conv = wrapper.status()["slots"]["conversations"]
            saves = [e for e in wrapper.events("conversations.saved") if e.get("why") == "checkpoint"]
            gaps = [b - a for a, b in itertools.pairwise(person.arrivals)]
            pause = killed_mid_turn(wrapper, messages)
            load = float(wrapper.events("child.ready")[-1]["load_s"])
            restored = sum(float(e.get("total_ms") or 0) for e in wrapper.events("slots.restored")) / 1000
        finally:
            wrapper.kill()
    server_s = sum(float(e.get("server_ms") or e["ms"]) for e in saves) / 1000
    megabytes = sum(int(e["bytes"]) for e in saves) / 1e6
    return {"share": share, "tokens_per_s": len(gaps) / sum(gaps), "longest_gap": max(gaps),
            "checkpoints": conv["checkpoints"], "stall_s": conv["checkpoints"]["stall_s"], "busy_s": took,
            "ms_per_mb": 1000 * server_s / megabytes if megabytes else float("nan"),
            "unkept": conv["unkept_tokens"], "pause": pause, "load": load, "restored": restored}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=4)
    options = parser.parse_args()
    server, model = models.llama_server(), models.demo()
    runs = [one_run(server, model, share, options.turns) for share in (0.05, 0.0)]
    print(f"checkpoints under load ({Path(model).name}, -np 2, an agent's {options.turns} turns of ~1.2k tokens each "
          "back to back, a person's stream in the other slot throughout):")
    print(f"{'checkpoint_share':>16} {'person tok/s':>12} {'longest gap':>11} {'busy':>4} {'idle':>4} {'stall s':>7} "
          f"{'of busy time':>12} {'ms/MB':>6} {'unkept':>6} {'pause':>6} {'load+restore':>12}")
    for run in runs:
        print(f"{run['share']:>16} {run['tokens_per_s']:>12.1f} {run['longest_gap'] * 1000:>9.0f}ms "
              f"{run['checkpoints']['busy']:>4} {run['checkpoints']['idle']:>4} {run['stall_s']:>7.3f} "
              f"{run['stall_s'] / run['busy_s']:>12.2%} {run['ms_per_mb']:>6.2f} {run['unkept']:>6} "
              f"{run['pause']:>5.2f}s {run['load'] + run['restored']:>11.2f}s")
    on, off = runs
    print(f"ratios (on / off): the person's decode rate x{on['tokens_per_s'] / off['tokens_per_s']:.3f}; what a crash "
          f"at the end would read again {on['unkept']} against {off['unkept']} tokens; the agent's pause at a kill "
          f"mid-turn x{on['pause'] / off['pause']:.2f} (with them {on['pause']:.2f} s against the new server's load "
          f"and restore {on['load'] + on['restored']:.2f} s: the rest, the prefill of what came since the checkpoint)")


if __name__ == "__main__":
    main()
