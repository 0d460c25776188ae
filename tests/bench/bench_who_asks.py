"""What telling who asks costs a request: a consumer by its key, a front-end's user by its header
(`consumers.by_header`), a request's `cache_salt` — each a turn that goes on in its own slot (SmolLM2 135M, -np 4,
examples/team.yaml as it is), against the same turn through a wrapper with no consumers configured at all. Both
wrappers run at once and their turns are interleaved, so that a busy machine slows every kind alike; printed: each
kind's median turn and its ratio to the turn without consumers.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_who_asks.py
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
from tests.helpers import ROOT, chat_yaml, http, running

ROUNDS = 30
MESSAGES = [{"role": "system", "content": "You are the team assistant. Answer briefly."},
            {"role": "user", "content": "Name three lighthouses of the northern sea. " * 20}]
KINDS: dict[str, tuple[dict[str, str], dict[str, Any]]] = {  # the key's header (and the user's), the body's extra
    "a consumer's key": ({"Authorization": "Bearer change-me-alice-key"}, {}),
    "a front-end's user": ({"Authorization": "Bearer change-me-open-webui-key", "X-OpenWebUI-User-Id": "u42"}, {}),
    "a cache_salt": ({"Authorization": "Bearer change-me-bob-key"}, {"cache_salt": "bench-salt-0123"}),
}


def turn(url: str, headers: dict[str, str], extra: dict[str, Any]) -> float:
    began = time.perf_counter()
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": MESSAGES, "max_tokens": 1, "temperature": 0, **extra}, headers=headers)
    assert status == 200, raw[:200]
    return time.perf_counter() - began


def main() -> None:
    server, model = models.llama_server(), models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", "4"]
    team = (ROOT / "examples" / "team.yaml").read_text()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        for setting in ("plain", "team"):
            (tmp / setting).mkdir()
        slots = team.replace("~/.cache/llama-wrapper/slots", str(tmp / "slots"))
        with running(tmp / "plain", argv, chat_yaml(tmp / "plain")) as plain, \
                running(tmp / "team", argv, slots) as w:
            alone: list[float] = []
            times: dict[str, list[float]] = {kind: [] for kind in KINDS}
            for k in range(ROUNDS + 1):  # interleaved, the first round left out (each conversation then in a slot)
                took = turn(plain.url, {}, {})
                alone += [took] if k else []
                for kind, (headers, extra) in KINDS.items():
                    took = turn(w.url, headers, extra)
                    times[kind] += [took] if k else []
    base = statistics.median(alone)
    print(f"model {Path(model).name}, -np 4, a ~250-token conversation going on, {ROUNDS} turns of each kind")
    print(f"{'who asks':<22} {'median turn ms':>15} {'x no consumers':>15}")
    print(f"{'no consumers':<22} {base * 1e3:>15.1f} {1.0:>15.2f}")
    for kind, each in times.items():
        print(f"{kind:<22} {statistics.median(each) * 1e3:>15.1f} {statistics.median(each) / base:>15.2f}")


if __name__ == "__main__":
    main()
