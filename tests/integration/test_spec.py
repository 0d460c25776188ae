"""Speculative decoding only while it pays, against the real server: SmolLM2 as its own draft (`-md` and
`--spec-type draft-simple`). One client drafts; three streaming at once for longer than `spec.calm` get a
reload without the draft, every stream answered; alone again the draft comes back when it pays (given), and
stays off when it was measured not to (this CPU: it does not pay even alone), each decision logged."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tests.helpers import Wrapper, http, running, wait_for

CONFIG = "spec: {{when: alone, calm: 3s{extra}}}\nreload: {{drain_timeout: 120s}}\n"


def argv(server_bin: str, demo_path: str) -> list[str]:
    return [server_bin, "-m", demo_path, "-md", demo_path, "--spec-type", "draft-simple", "-c", "4096", "-np", "3"]


def one(url: str, n: int = 32) -> dict[str, Any]:
    status, _, raw = http("POST", f"{url}/completion", {"prompt": "Once upon a time", "n_predict": n,
                                                       "ignore_eos": True, "temperature": 0}, timeout=300)
    assert status == 200, raw[:300]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def crowd(url: str, clients: int = 3, n: int = 160) -> list[bytes]:
    """`clients` streams at once; each one's whole body."""
    bodies: list[bytes] = [b""] * clients

    def stream(index: int) -> None:
        status, _, raw = http("POST", f"{url}/completion", {"prompt": f"Client {index} tells a story:",
                                                           "n_predict": n, "ignore_eos": True, "stream": True},
                              timeout=600)
        bodies[index] = raw if status == 200 else f"status {status}".encode() + raw

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    return bodies


def answered_whole(body: bytes, n: int = 160) -> bool:
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    return bool(events) and not any("error" in e for e in events) and events[-1].get("stop") is True and \
        sum(1 for e in events if e.get("content")) >= n // 2


def running_draft(wrapper: Wrapper) -> bool:
    spec: dict[str, Any] = wrapper.status()["spec"]
    return bool(spec["running"])


def switched(wrapper: Wrapper, draft: bool) -> list[dict[str, Any]]:
    return [e for e in wrapper.events("spec.switched") if e["draft"] is draft]


def test_a_crowd_turns_the_draft_off_and_alone_it_comes_back_when_it_pays(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), CONFIG.format(extra=", alone_speedup: 2"),
                 env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as wrapper:
        assert one(wrapper.url)["timings"]["draft_n"] > 0
        bodies = crowd(wrapper.url)
        assert all(answered_whole(body) for body in bodies), [b[-300:] for b in bodies]
        wait_for(lambda: switched(wrapper, False), 60, "the draft switched off for the crowd")
        assert "--spec-type" not in wrapper.status()["server"]["argv"]
        wait_for(lambda: switched(wrapper, True), 60, "the draft back on, alone again")
        wait_for(lambda: wrapper.status()["state"] == "ready" and running_draft(wrapper), 60, "the draft running")
        assert one(wrapper.url)["timings"]["draft_n"] > 0
        decisions = wrapper.events("spec.decision")
        off = next(d for d in decisions if d["switch"] and not d["draft"])
        assert off["crowd"] is True and off["speedup"] == 0.75 and "assumed" in off["source"]
        on = next(d for d in decisions if d["switch"] and d["draft"])
        assert on["crowd"] is False and on["source"] == "spec.alone_speedup" and on["alone_with"] > 0
        assert wrapper.stop() == 0


def test_measured_not_to_pay_alone_the_draft_stays_off_and_the_log_says_why(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # this machine's rates: none yet, kept for the next
    with running(tmp_path, argv(server_bin, demo_path), CONFIG.format(extra=""), env=cache) as wrapper:
        assert one(wrapper.url)["timings"]["draft_n"] > 0  # alone with the draft: measured
        assert all(answered_whole(body) for body in crowd(wrapper.url))
        wait_for(lambda: switched(wrapper, False) and wrapper.status()["state"] == "ready", 60, "the draft off")
        without = one(wrapper.url)  # alone without the draft: measured
        assert "draft_n" not in without["timings"] or without["timings"]["draft_n"] == 0
        stays = wait_for(lambda: [d for d in wrapper.events("spec.decision") if not d["crowd"] and not d["draft"]],
                         30, "the decision that the draft does not pay alone")
        assert stays[0]["source"] == "measured alone" and stays[0]["speedup"] < 1, stays
        assert stays[0]["alone_with"] < stays[0]["alone_without"]
        assert "does not pay" in stays[0]["reason"]
        rates = wrapper.status()["spec"]["rates"]
        assert rates["alone_with"] and rates["alone_without"]
        assert not switched(wrapper, True) and not running_draft(wrapper)
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), CONFIG.format(extra=""), env=cache) as again:
        kept = again.status()["spec"]["rates"]  # a wrapper started again (llama-swap) knows them already
        assert kept["alone_with"] and kept["alone_without"]
        assert again.stop() == 0
