"""The watchdog with the tiny real child: a hung server (SIGSTOP) is noticed and started again, requests held
meanwhile and the one in flight sent again to the new one; a crash likewise; the budget of restarts; the hang
rules on their own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from http.client import HTTPConnection, IncompleteRead
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tests.helpers import Wrapper, child_argv, http, pid_alive, running, wait_for
from wrapper.configuration.sections import WatchdogSettings
from wrapper.life.watchdog import BUSY_MIN_S, Budget, Lost, Watched, computed, hung, progress
from wrapper.lifecycle import State
from wrapper.server.child import cpu_seconds
from wrapper.serving import GONE_WHY

FAST = "watchdog: {health_timeout: 1s, stall: 2s}\n"


def pid(wrapper: Wrapper) -> int:
    found: int = wrapper.status()["server"]["pid"]
    return found


def test_a_hung_server_is_noticed_killed_and_started_again_and_the_request_in_flight_answered(
        tmp_path: Path) -> None:
    # The request must reach the wrapper before the hang is noticed, which FAST's looks (every 0.33 s) may do 0.67 s
    # after the SIGSTOP: a busy machine took longer to send it (it was then held, not sent again). Here the hang
    # is noticed 2 s after the SIGSTOP at the earliest.
    with running(tmp_path, child_argv(), "watchdog: {health_timeout: 3s, stall: 6s}\n", timeout=30) as wrapper:
        hung_pid = pid(wrapper)
        os.kill(hung_pid, signal.SIGSTOP)  # a driver stall, a deadlock: nothing answers, nothing dies
        answers: list[tuple[int, bytes]] = []
        waiting = threading.Thread(target=lambda: answers.append(
            http("POST", f"{wrapper.url}/echo", {"n": 1}, timeout=60)[::2]))
        waiting.start()  # in flight to the hung server: it hears nothing
        wait_for(lambda: wrapper.events("wrapper.server_back"), 30, "the server started again")
        waiting.join(30)
        assert answers and answers[0][0] == 200 and json.loads(answers[0][1])["path"] == "/echo"
        assert not pid_alive(hung_pid) and pid(wrapper) != hung_pid
        (lost,) = wrapper.events("wrapper.server_lost")
        assert lost["reason"] == "hang" and "/health unanswered" in lost["why"], lost
        (restarting,) = wrapper.events("wrapper.restarting_server")
        assert restarting["on"] == "hang" and wrapper.events("wrapper.request_again")
        status = wrapper.status()
        assert status["restarts"]["count"] == 1 and status["restarts"]["last"]["reason"] == "hang"
        assert status["state"] == "ready" and wrapper.health() == 200
        assert wrapper.stop() == 0


def test_requests_arriving_while_it_restarts_are_held_not_refused(tmp_path: Path) -> None:
    with running(tmp_path, child_argv(), FAST, timeout=30) as wrapper:
        os.kill(pid(wrapper), signal.SIGSTOP)
        wait_for(lambda: wrapper.status()["state"] == "restarting", 30, "the restart to begin")
        assert wrapper.health() == 503  # llama-swap and Kubernetes see it is not serving
        status, _, raw = http("GET", f"{wrapper.url}/v1/models", timeout=60)
        assert status == 200, raw  # held until the new server serves
        assert wrapper.stop() == 0


def test_a_server_that_dies_at_every_start_is_given_up_with_its_status(tmp_path: Path) -> None:
    marker = tmp_path / "started-once"
    script = tmp_path / "server.sh"  # starts once; every start after a crash fails with status 5
    script.write_text(f"#!/bin/sh\ncase \"$*\" in *--help*|*--version*|*--list-devices*) exit 0;; esac\n"
                      f"if [ -e {marker} ]; then echo broken; exit 5; fi\ntouch {marker}\n"
                      f"exec {' '.join(child_argv('--die-after', '2', '--exit-code', '9'))} \"$@\"\n")
    script.chmod(0o755)
    with Wrapper(tmp_path, [str(script)], "watchdog: {restarts: 3}\n") as wrapper:
        assert wrapper.wait(60) == 5  # the last server's own status
    failed = wrapper.events("wrapper.restart_failed")
    assert [e["attempt"] for e in failed] == [1, 2, 3] and "status 5" in failed[0]["error"]
    assert wrapper.events("wrapper.giving_up") and wrapper.events("wrapper.stopped")[0]["result"] == "exit-code"


def test_a_stream_cut_by_a_crash_the_wrapper_gives_up_on_is_told_so_in_an_error_event(tmp_path: Path) -> None:
    with running(tmp_path, child_argv(), "watchdog: {restarts: 0}\n", timeout=30) as wrapper:
        host, port = wrapper.url.removeprefix("http://").split(":")
        connection = HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/stream?n=100&delay=0.05")
        reply = connection.getresponse()
        assert reply.readline().startswith(b"data: ")  # the stream is under way
        os.kill(pid(wrapper), signal.SIGKILL)
        rest = b""
        with contextlib.suppress(IncompleteRead, ConnectionError):
            while chunk := reply.read1(65536):
                rest += chunk
        errors = [json.loads(line[5:]) for line in rest.split(b"\n") if line.startswith(b"data: {\"error\"")]
        assert errors and errors[-1]["error"]["message"] == GONE_WHY, rest[-300:]
        assert wrapper.wait(30) == 137  # the server's status: llama-swap or systemd take over
    (lost,) = wrapper.events("wrapper.server_lost")
    assert lost["in_flight"] == 1, lost  # the stream it cut, whether or not its cut was seen first


def test_a_hang_given_up_on_is_killed_at_once_not_stopped(tmp_path: Path) -> None:
    with running(tmp_path, child_argv(), "watchdog: {health_timeout: 1s, stall: 2s, restarts: 0}\n",
                 timeout=30) as wrapper:
        os.kill(pid(wrapper), signal.SIGSTOP)
        assert wrapper.wait(30) == 137
    assert wrapper.events("wrapper.giving_up") and not wrapper.events("child.stopping")  # no SIGTERM to wait out
    (stopped,) = wrapper.events("wrapper.stopped")
    assert stopped["result"] == "watchdog", stopped  # as systemd names it; not a stop that timed out


def test_the_budget_counts_restarts_within_the_window() -> None:
    now = [0.0]
    budget = Budget(2, 60.0, lambda: now[0])
    lost = Lost("crash", "killed by SIGKILL")
    assert budget.allows()
    budget.spend(lost)
    now[0] = 10.0
    budget.spend(lost)
    assert not budget.allows()  # two within the minute
    now[0] = 61.0
    assert budget.allows()  # the first left the window
    assert budget.count == 2 and budget.last is not None and budget.last["reason"] == "crash"


class Client:
    def __init__(self, healthy: list[bool], slots: Sequence[list[dict[str, Any]] | None]) -> None:
        slots = list(slots)
        self._healthy, self._slots = healthy, slots

    async def healthy(self, timeout: float) -> bool:
        return self._healthy.pop(0) if len(self._healthy) > 1 else self._healthy[0]

    async def slots(self) -> list[dict[str, Any]]:
        answer = self._slots.pop(0) if len(self._slots) > 1 else self._slots[0]
        if answer is None:
            await asyncio.sleep(3600)  # no answer
        assert answer is not None
        return answer


def watched(client: Client, in_flight: int, heard_at: float,
            cpu_time: Callable[[], float | None] = lambda: None) -> Watched:
    generation = SimpleNamespace(client=client, alive=True)
    return cast(Watched, SimpleNamespace(current=generation, state=State.READY, in_flight=in_flight,
                                         heard_at=heard_at, cpu_time=cpu_time))


def using(share: float | None) -> Callable[[], float | None]:
    """A server's CPU time that moves at `share` of a core's (None: there is no /proc to read it from)."""
    return lambda: None if share is None else share * time.monotonic()


def slot(task: int, processed: int, decoded: int) -> dict[str, Any]:
    return {"id": 0, "id_task": task, "n_prompt_tokens_processed": processed,
            "next_token": [{"n_decoded": decoded}]}


async def test_a_long_prefill_is_progress_not_a_hang() -> None:
    """Nothing heard for longer than the stall, but the slot finishes a batch now and then."""
    batches = [[slot(1, 2048 * (i // 2), 0)] for i in range(40)]  # a batch every other look
    settings = WatchdogSettings(health_timeout=30.0, stall=0.9)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(hung(watched(Client([True], batches), 1, 0.0), settings), 2.5)


async def test_a_request_that_hears_nothing_while_no_slot_moves_is_a_hang() -> None:
    settings = WatchdogSettings(health_timeout=30.0, stall=0.9)
    found = await asyncio.wait_for(hung(watched(Client([True], [[slot(1, 0, 3)]]), 1, 0.0), settings), 10)
    assert found.reason == "hang" and "heard nothing and no slot made progress for" in found.why


@pytest.mark.parametrize(("share", "is_hung"), [
    (1.0, False),  # one thread computes a prompt batch (/slots waits for its end)
    (0.2, False),  # the same on a loaded machine: a fifth of a core
    (0.01, True),  # idle but polled: the HTTP thread answers /health
    (0.0, True),  # stopped (SIGSTOP), or blocked
    (None, True),  # no /proc: only a slot's progress counts, as before
])
async def test_a_server_that_computes_is_not_hung_and_one_whose_cpu_stands_still_is(share: float | None,
                                                                                    is_hung: bool) -> None:
    settings = WatchdogSettings(health_timeout=30.0, stall=0.6)
    watching = hung(watched(Client([True], [None]), 1, 0.0, using(share)), settings)  # /slots never answers
    if not is_hung:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watching, 2.0)  # more than three stalls
        return
    found = await asyncio.wait_for(watching, 10)
    assert found.reason == "hang" and "no slot made progress" in found.why
    assert ("CPU time stood still" in found.why) is (share is not None), found.why


@pytest.mark.parametrize(("before", "after", "moved"), [
    ((0.0, 10.0), (1.0, 11.0), True),  # a core's second in a second
    ((0.0, 10.0), (1.0, 10.06), True),  # 6 %
    ((0.0, 10.0), (1.0, 10.04), False),  # 4 %: under BUSY
    ((0.0, 10.0), (0.2, 10.01), False),  # 5 % of a short look, but under BUSY_MIN_S
    ((0.0, 10.0), (0.2, 10.0 + BUSY_MIN_S), True),
    ((0.0, 10.0), (1.0, 2.0), False),  # another process (started again): not computing
    ((0.0, None), (1.0, 11.0), False),  # unknown
    ((0.0, 10.0), (1.0, None), False),
])
def test_computing_is_cpu_time_moving_by_a_share_of_the_wall_time(
        before: tuple[float, float | None], after: tuple[float, float | None], moved: bool) -> None:
    assert computed(before, after) is moved


def test_cpu_seconds_are_read_from_proc() -> None:
    first = cpu_seconds(os.getpid())
    assert first is not None
    deadline = time.monotonic() + 10
    while (cpu_seconds(os.getpid()) or 0.0) - first < 0.05 and time.monotonic() < deadline:
        sum(range(10_000))  # compute
    assert (cpu_seconds(os.getpid()) or 0.0) - first >= 0.05
    assert cpu_seconds(2**22 + 1) is None  # above the largest pid: no such process


async def test_health_unanswered_is_a_hang_and_idle_with_no_requests_is_not_a_stall() -> None:
    settings = WatchdogSettings(health_timeout=0.9, stall=0.9)
    with pytest.raises(TimeoutError):  # idle: nothing in flight, /health fine
        await asyncio.wait_for(hung(watched(Client([True], [None]), 0, 0.0), settings), 2.0)
    found = await asyncio.wait_for(hung(watched(Client([False], [None]), 0, 0.0), settings), 10)
    assert "/health unanswered" in found.why


def test_progress_is_what_changes_while_a_slot_works() -> None:
    assert progress([slot(1, 0, 0)]) != progress([slot(1, 2048, 0)]) != progress([slot(1, 2048, 1)])
    assert progress([slot(1, 5, 5)]) == progress([slot(1, 5, 5)])
