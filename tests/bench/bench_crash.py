"""What a crash costs a client, and what keeping conversations while they are in their slots costs.

One wrapper (`-np 2`, slots save/restore, the conversation cache, checkpoints every `CHECKPOINT` tokens):
  checkpoints  a conversation grows turn by turn; after each turn, once idle, it is kept again: the bytes each
               checkpoint wrote (only the chunks it added) against the conversation's whole state, and the
               save's time — the longest a request arriving at that moment waits (llama-server's loop is busy
               with the save) — with a prediction for a larger model from its state size at that rate
  crash        a streamed answer, llama-server SIGKILLed 20 tokens in: the pause the client sees (the kill to the
               next token), against the same answer's time between two tokens, and whether the stream came
               back whole

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_crash.py [--model gemma]
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
from tests.helpers import Wrapper, chat, http, wait_for

CHECKPOINT = 256
CONFIG = f"""
slots: {{{{dir: {{dir}}}}}}
cache: {{{{checkpoint_tokens: {CHECKPOINT}}}}}
hooks:
  on_startup: [{{{{builtin: slots.restore}}}}]
  on_will_stop: [{{{{builtin: slots.save}}}}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
GEMMA_27B_KV_PER_TOKEN = 15.5 * 2**30 / 32768  # f16, --swa-full (the README's recipe): bytes of KV per token



def checkpoints(wrapper: Wrapper, turns: int = 6) -> list[dict[str, Any]]:
    messages: list[dict[str, str]] = []
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Part {turn + 1} of the ledger: " + STORY * 20})
        answer = chat(wrapper.url, messages, max_tokens=16)
        messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        seen = len(wrapper.events("conversations.checkpoint"))

        def kept_again(seen: int = seen) -> bool:
            return len(wrapper.events("conversations.checkpoint")) > seen

        wait_for(kept_again, 60, "a checkpoint")
        kept = wrapper.events("conversations.checkpoint")[-1]
        saved = [e for e in wrapper.events("conversations.saved") if e.get("why") == "checkpoint"][-1]
        rows.append({"turn": turn + 1, "tokens": kept["tokens"], "written": kept["written"],
                     "state": saved["bytes"], "ms": float(saved.get("server_ms") or saved["ms"])})
    return rows


def stall(wrapper: Wrapper, slot: int) -> dict[str, Any]:
    """A stream in the other slot while the checkpointed slot is saved (what a checkpoint does, but with a stream
    under way, which the checkpoint's idle wait avoids): the longest gap between its tokens against the usual."""
    server = wrapper.status()["server"]["url"]
    host, port = server.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    body = {"prompt": "Tell me a long story about a lighthouse.", "n_predict": 200, "temperature": 0,
            "stream": True, "ignore_eos": True, "id_slot": 1 - slot}
    connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    arrivals: list[float] = []
    saving: list[tuple[float, float, dict[str, Any]]] = []
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        arrivals.append(time.perf_counter())
        if len(arrivals) == 40:  # mid-stream: the save, from another thread as the wrapper's checkpoint would
            def save() -> None:
                began = time.perf_counter()
                status, _, raw = http("POST", f"{server}/slots/{slot}?action=save", {"filename": "bench-stall.bin"},
                                      timeout=120)
                assert status == 200, raw[:300]
                saving.append((began, time.perf_counter(), json.loads(raw)))
            threading.Thread(target=save).start()
    connection.close()
    wait_for(lambda: saving, 60, "the save")
    began, ended, answer = saving[0]
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(arrivals)]
    during = max(gap for gap, a, b in gaps if b > began and a < ended)
    usual = sorted(gap for gap, _, _ in gaps[:39])[19]
    return {"longest": during, "usual": usual, "tokens": answer.get("n_saved"),
            "save_ms": answer.get("timings", {}).get("save_ms")}


def crash(wrapper: Wrapper) -> dict[str, Any]:
    host, port = wrapper.url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": 120, "temperature": 0, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    pid = int(wrapper.status()["server"]["pid"])
    arrivals: list[float] = []
    killed_at, done = None, False
    for raw in reply:
        line = raw.decode().strip()
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data:") and json.loads(line[5:])["choices"][0]["delta"].get("content"):
            arrivals.append(time.perf_counter())
            if killed_at is None and len(arrivals) == 20:
                killed_at = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
    connection.close()
    assert killed_at is not None
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    pause = arrivals[20] - killed_at if len(arrivals) > 20 else float("nan")
    usual = sorted(gaps[:19])[len(gaps[:19]) // 2]
    return {"pause": pause, "usual": usual, "tokens": len(arrivals), "whole": done}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["demo", "gemma"], default="demo")
    options = parser.parse_args()
    server = models.llama_server()
    model = models.gemma() if options.model == "gemma" else models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", "2"]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        wrapper = Wrapper(tmp, argv, CONFIG.format(dir=tmp / "slots"), extra=["--log-level", "info"])
        try:
            wrapper.wait_ready(300)
            rows = checkpoints(wrapper)
            stalled = stall(wrapper, wrapper.events("conversations.checkpoint")[-1]["slot"])
            crashed = crash(wrapper)
        finally:
            wrapper.stop(120)
            wrapper.kill()
    print(f"checkpoints ({Path(model).name}, every {CHECKPOINT} tokens, once idle 2 s):")
    print(f"{'turn':>4} {'tokens':>7} {'state MB':>9} {'written MB':>11} {'share':>6} {'save ms':>8}")
    for row in rows:
        print(f"{row['turn']:>4} {row['tokens']:>7} {row['state'] / 1e6:>9.1f} {row['written'] / 1e6:>11.2f} "
              f"{row['written'] / max(1, row['state']):>6.2f} {row['ms']:>8.1f}")
    rate = sum(r["state"] for r in rows) / max(1e-9, sum(r["ms"] for r in rows) / 1000)
    big = GEMMA_27B_KV_PER_TOKEN * 16384
    print(f"save rate {rate / 1e6:.0f} MB/s: a Gemma 3 27B slot of 16k tokens ({big / 2**30:.1f} GiB) would take "
          f"{big / rate:.1f} s, the longest a request arriving at that moment waits")
    print(f"a save under a stream in the other slot ({stalled['tokens']} tokens, {stalled['save_ms']:.1f} ms): its "
          f"longest gap {stalled['longest'] * 1000:.1f} ms against {stalled['usual'] * 1000:.1f} ms usually — the "
          "stall a checkpoint would cause, which waiting until no request is in flight avoids")
    print(f"crash: the client waited {crashed['pause']:.2f} s for the next token after the kill (a token usually "
          f"comes every {crashed['usual'] * 1000:.0f} ms: x{crashed['pause'] / crashed['usual']:.0f}); "
          f"{crashed['tokens']} tokens, one stream to its end: {crashed['whole']}")


if __name__ == "__main__":
    main()
