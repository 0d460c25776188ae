"""A streamed answer read event by event through the wrapper, llama-server SIGKILLed at the moment a test chooses:
for the tests of what a crash costs (tests/integration/test_watchdog.py, tests/integration/test_crash.py)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from http.client import HTTPConnection
from typing import Any

from tests.helpers import Wrapper, http, wait_for

Events = list[dict[str, Any]]


def server_pid(wrapper: Wrapper) -> int:
    found: int = wrapper.status()["server"]["pid"]
    return found


def streamed(wrapper: Wrapper, body: dict[str, Any], kill_when: Callable[[Events], bool] | None = None,
             path: str = "/v1/chat/completions", sig: signal.Signals = signal.SIGKILL) -> Events:
    """A streamed answer read event by event (a Responses or Messages event's payload gets its `event:` name as
    `event`; `data: [DONE]` is {"done": True}); `sig` to llama-server once `kill_when(events)` is true."""
    host, port = wrapper.url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    connection.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()[:300]
    events: Events = []
    name, killed, pid = None, False, server_pid(wrapper)
    for raw in reply:
        line = raw.decode().strip()
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
            if name is not None:
                events[-1]["event"] = name
                assert events[-1].get("type") == name, events[-1]  # the name and the type agree
            if kill_when is not None and not killed and kill_when(events):
                os.kill(pid, sig)
                killed = True
    connection.close()
    assert kill_when is None or killed, "the answer ended before the moment to kill it came"
    return events


def deltas(events: Events) -> list[dict[str, Any]]:
    """A chat stream's deltas."""
    return [e["choices"][0]["delta"] for e in events if e.get("choices")]


def content(events: Events) -> str:
    """A chat stream's text."""
    return "".join(d.get("content") or "" for d in deltas(events))


def contents(events: Events) -> int:
    """A chat stream's text events."""
    return sum(1 for d in deltas(events) if d.get("content"))


def killed_while_answering(wrapper: Wrapper, path: str, body: dict[str, Any], into_s: float = 0.5) -> tuple[int, bytes]:
    """A request that asked for one JSON answer, llama-server SIGKILLed `into_s` after a slot began working on it
    (its prompt or its answer): the status and body the client got."""
    got: list[tuple[int, bytes]] = []

    def ask() -> None:
        status, _, raw = http("POST", f"{wrapper.url}{path}", body, timeout=600)
        got.append((status, raw))

    asking = threading.Thread(target=ask)
    pid = server_pid(wrapper)
    asking.start()
    wait_for(lambda: any(s.get("is_processing") for s in json.loads(http("GET", f"{wrapper.url}/slots")[2])),
             60, "the answer under way")
    time.sleep(into_s)  # into the work: not a timing the test asserts
    os.kill(pid, signal.SIGKILL)
    asking.join(600)
    assert got, "no answer"
    return got[0]
