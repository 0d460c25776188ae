"""POST /wrapper/drain (what a Kubernetes preStop hook calls) against a tiny real child."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers import child_argv, http, running, wait_for

TOKEN = "drain-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def stream(url: str, events: list[str]) -> None:
    with urllib.request.urlopen(f"{url}/stream?n=20&delay=0.1", timeout=60) as reply:
        events += [line.decode() for line in reply if line.startswith(b"data:")]


def test_a_drain_refuses_at_once_lets_streams_finish_saves_and_leaves_a_quick_stop(tmp_path: Path) -> None:
    saved = tmp_path / "saved.log"
    config = f"hooks:\n  on_will_stop:\n    - name: save\n      shell: echo saved >> {saved}\n"
    with running(tmp_path, child_argv(), config, timeout=30, env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        assert http("POST", f"{wrapper.url}/wrapper/drain", {})[0] == 401  # the admin token, as for a reload
        events: list[str] = []
        streaming = threading.Thread(target=stream, args=(wrapper.url, events))
        streaming.start()
        wait_for(lambda: wrapper.status()["requests"]["in_flight"] == 1, 10, "the stream to be in flight")
        answers: list[tuple[int, Any]] = []

        def drain() -> None:
            status, _, raw = http("POST", f"{wrapper.url}/wrapper/drain", {"timeout": "20s"}, headers=ADMIN,
                                  timeout=60)
            answers.append((status, json.loads(raw)))

        first = threading.Thread(target=drain)
        first.start()
        wait_for(lambda: wrapper.health() == 503, 2, "/health to say 503 at once")
        status, headers, _ = http("GET", f"{wrapper.url}/anything")
        assert status == 503 and headers.get("Retry-After")
        second = threading.Thread(target=lambda: answers.append(  # the same drain, as a preStop httpGet: it waits
            (lambda r: (r[0], json.loads(r[2])))(http("GET", f"{wrapper.url}/wrapper/drain?timeout=20s",
                                                      headers=ADMIN, timeout=60))))
        second.start()
        for thread in (streaming, first, second):
            thread.join(60)
        assert len(events) == 20  # the stream in flight finished whole
        assert [status for status, _ in answers] == [200, 200] and answers[0][1] == answers[1][1]
        answer = answers[0][1]
        assert answer["drained"] and answer["in_flight"] == 1 and answer["left_in_flight"] == 0
        assert [(r["action"], r["outcome"]) for r in answer["on_will_stop"]] == [("save", "ok")]
        assert saved.read_text() == "saved\n"
        began = time.monotonic()
        assert wrapper.stop() == 0
        assert time.monotonic() - began < 1.0  # nothing left to drain or save
        assert saved.read_text() == "saved\n"  # on_will_stop ran once
        assert wrapper.events("wrapper.drained")


def test_a_request_waiting_for_a_slot_when_a_drain_begins_is_refused_then_not_when_the_slot_frees(
        tmp_path: Path) -> None:
    """One slot, held by a request the child keeps until /release: a second one waits for it in the queue. A drain
    refuses that one at once (503), while the first still holds the slot; the first then finishes."""
    with running(tmp_path, child_argv(), None, timeout=30, env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        answers: dict[str, int] = {}
        holding = threading.Thread(target=lambda: answers.setdefault(
            "first", http("POST", f"{wrapper.url}/completion?hold=1", {"prompt": "a"}, timeout=60)[0]))
        holding.start()
        wait_for(lambda: len(wrapper.status()["priority"]["running"]) == 1, 10, "the first to take the slot")
        waiting = threading.Thread(target=lambda: answers.setdefault(
            "second", http("POST", f"{wrapper.url}/completion", {"prompt": "b"}, timeout=60)[0]))
        waiting.start()
        wait_for(lambda: len(wrapper.status()["priority"]["waiting"]) == 1, 10, "the second to wait for it")
        draining = threading.Thread(target=lambda: answers.setdefault("drain", http(
            "POST", f"{wrapper.url}/wrapper/drain", {"timeout": "30s"}, headers=ADMIN, timeout=60)[0]))
        draining.start()
        waiting.join(30)
        assert answers.get("second") == 503 and "first" not in answers  # refused while the slot is still held
        assert not wrapper.status()["priority"]["waiting"]
        server = wrapper.status()["server"]["url"]
        assert http("GET", f"{server}/release")[0] == 200
        for thread in (holding, draining):
            thread.join(30)
        assert answers == {"second": 503, "first": 200, "drain": 200}
