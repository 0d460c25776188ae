"""systemd's notify protocol against a real AF_UNIX datagram socket, the wrapper around a tiny real child."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Wrapper, child_argv, http, wait_for
from wrapper.life.notify import Notifier
from wrapper.lifecycle import State

TOKEN = "notify-token"


class Listener:
    """What systemd would read from $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[list[str]] = []

    def read(self) -> list[list[str]]:
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode().split("\n"))
            except TimeoutError:
                return self.messages

    def has(self, line: str) -> bool:
        return any(line in message for message in self.read())


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    path = Path("/tmp") / f"notify-{time.monotonic_ns()}.sock"  # AF_UNIX paths are short: not under tmp_path
    found = Listener(path)
    try:
        yield found
    finally:
        found.sock.close()
        path.unlink(missing_ok=True)


def test_ready_only_after_the_start_hooks_reloading_then_ready_stopping_at_stop(tmp_path: Path,
                                                                                listener: Listener) -> None:
    gate = tmp_path / "gate"
    config = f"hooks:\n  on_startup:\n    - shell: while [ ! -e {gate} ]; do sleep 0.05; done\n      timeout: 30s\n"
    env = {"NOTIFY_SOCKET": listener.sock.getsockname(), "LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}
    with Wrapper(tmp_path, child_argv(), config, env=env) as wrapper:
        wait_for(lambda: listener.has("STATUS=starting: running on_startup (restoring slots)"), 30,
                 "the restore phase to be announced")
        assert not listener.has("READY=1")  # the model is loaded, but the restore is not done
        gate.touch()
        wrapper.wait_ready(30)
        wait_for(lambda: listener.has("READY=1"), 10, "READY=1")
            # a switch the child's --help (python's) lists and the child ignores: a reload that changes something
        # a switch the child's --help (python's) lists and the child ignores: a reload that changes something
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", {"args": {"set": {"-B": True}}},
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert status == 200, raw
        assert wrapper.stop() == 0
    lines = [line for message in listener.read() for line in message]
    assert [line for line in lines if line in ("READY=1", "RELOADING=1", "STOPPING=1")] == \
        ["READY=1", "RELOADING=1", "READY=1", "STOPPING=1"]
    reloading = next(message for message in listener.messages if "RELOADING=1" in message)
    assert any(line.startswith("MONOTONIC_USEC=") and int(line.split("=")[1]) > 0 for line in reloading)


def test_nothing_is_sent_without_the_variable_and_the_watchdog_pings_while_it_answers(listener: Listener) -> None:
    Notifier({}).follow(State.READY)  # no NOTIFY_SOCKET: nothing, no error
    assert listener.read() == []
    notifier = Notifier({"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "2000000"})
    assert notifier.watchdog_s == 1.0
    notifier.watchdog()
    assert listener.read() == [["WATCHDOG=1"]]
    Notifier({"NOTIFY_SOCKET": "/nonexistent/socket"}).send("READY=1")  # logged once, never raised


def test_a_reader_that_lags_never_stalls_the_sender(listener: Listener) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": listener.sock.getsockname()})

    def flood() -> None:
        for _ in range(500):
            notifier.watchdog()

    sending = threading.Thread(target=flood, daemon=True)
    sending.start()  # far more than a datagram socket queues: the ones over are dropped, not waited for
    sending.join(10)
    assert not sending.is_alive()
    assert listener.read()[0] == ["WATCHDOG=1"]


def test_a_restart_is_announced_and_the_watchdog_pings_on_while_the_server_loads_again(tmp_path: Path,
                                                                                      listener: Listener) -> None:
    env = {"NOTIFY_SOCKET": listener.sock.getsockname(), "WATCHDOG_USEC": "1000000"}  # a ping every 0.5 s
    with Wrapper(tmp_path, child_argv("--load-delay", "3"), "", env=env) as wrapper:
        wrapper.wait_ready(30)
        os.kill(wrapper.status()["server"]["pid"], signal.SIGKILL)
        wait_for(lambda: listener.read() and wrapper.events("wrapper.server_back"), 30, "the server started again")
        assert wrapper.stop() == 0
    lines = [line for message in listener.read() for line in message]
    began = next(i for i, line in enumerate(lines) if line.startswith("STATUS=restarting llama-server (crash"))
    back = lines.index("READY=1", began)
    assert lines.count("READY=1") == 2  # ready, then ready again once the new server answers
    # the new server loads for 3 s: systemd hears the wrapper all along, or WatchdogSec would kill it mid-restart
    assert lines[began:back].count("WATCHDOG=1") >= 3, lines[began:back]
