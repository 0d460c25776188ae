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
