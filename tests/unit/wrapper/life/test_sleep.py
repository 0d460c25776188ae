"""Sleep without llama-server: the gate while asleep (a request wakes the server, a failed wake answers those held),
the section, and the whole cycle with a tiny real child (the hooks of a sleep and of a wake, what a client polls
answered while asleep)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.asking import Asked
from tests.helpers import Wrapper, child_argv, http, wait_for
from wrapper import built_ins
from wrapper.configuration.config import ConfigError
from wrapper.configuration.sections import SLEEP
from wrapper.life.sleep_cycle import why_sleep
from wrapper.life.sleeping import Sleep
from wrapper.lifecycle import IllegalTransition, Lifecycle, State
from wrapper.queue.gate import Admission, Gate


def asleep_gate() -> tuple[Gate, Lifecycle, list[int]]:
    gate = Gate()
    woken: list[int] = []
    gate.wake = lambda: woken.append(1)
    lifecycle = Lifecycle(gate.follow)
    for state in (State.STARTING, State.READY, State.SLEEPING, State.ASLEEP):
        lifecycle.to(state)
    return gate, lifecycle, woken


async def test_a_request_while_asleep_wakes_the_server_and_passes_once_ready() -> None:
    gate, lifecycle, woken = asleep_gate()
    entering = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0.01)
    assert woken and gate.held == 1 and not entering.done()
    lifecycle.to(State.WAKING)
    await asyncio.sleep(0.01)
    assert not entering.done()
    lifecycle.to(State.READY)
    assert await entering is Admission.ADMITTED and gate.in_flight == 1


async def test_a_failed_wake_answers_the_held_and_the_next_request_wakes_it_again() -> None:
    gate, lifecycle, woken = asleep_gate()
    held = [asyncio.ensure_future(gate.enter()) for _ in range(3)]
    await asyncio.sleep(0.01)
    lifecycle.to(State.WAKING)
    lifecycle.to(State.ASLEEP)
    gate.turn_away("the model file is gone")
    assert [await h for h in held] == [Admission.NOT_WOKEN] * 3
    assert gate.wake_failed == "the model file is gone" and gate.held == 0
    woken.clear()
    later = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0.01)
    assert woken and not later.done()  # held for the next wake, not turned away by the last one
    lifecycle.to(State.WAKING)
    lifecycle.to(State.READY)
    assert await later is Admission.ADMITTED


async def test_a_stop_while_asleep_refuses_the_held() -> None:
    gate, lifecycle, _ = asleep_gate()
    held = asyncio.ensure_future(gate.enter())
    await asyncio.sleep(0.01)
    lifecycle.to(State.STOPPING)
    assert await held is Admission.REFUSED


async def test_what_clients_poll_does_not_keep_the_server_awake() -> None:
    gate = Gate()
    Lifecycle(gate.follow).to(State.STARTING)
    gate.follow(State.READY)
    before = gate.active_at
    await asyncio.sleep(0.02)
    assert await gate.enter(counted=False, active=False) is Admission.ADMITTED
    assert gate.active_at == before
    assert await gate.enter() is Admission.ADMITTED
    assert gate.active_at > before and gate.idle_s() == 0.0
    gate.leave()
    assert gate.idle_s() >= 0.0


def test_a_sleep_goes_only_where_the_states_allow() -> None:
    lifecycle = Lifecycle()
    for state in (State.STARTING, State.READY, State.SLEEPING, State.ASLEEP, State.WAKING, State.ASLEEP,
                  State.WAKING, State.READY, State.SLEEPING, State.READY):
        lifecycle.to(state)
    with pytest.raises(IllegalTransition):
        lifecycle.to(State.ASLEEP)  # from ready: only through falling asleep
    lifecycle.to(State.SLEEPING)
    lifecycle.to(State.ASLEEP)
    with pytest.raises(IllegalTransition):
        lifecycle.to(State.RELOADING)  # a reload while asleep waits for the wake (Serving.reload)


@pytest.mark.parametrize(("text", "after"), [("10s", 10.0), ("2m", 120.0), ("off", None), ("", None)])
def test_sleep_after_reads_a_duration_or_off(text: str, after: float | None) -> None:
    config = built_ins.parse(f"sleep:\n  after: {text}\n")
    assert SLEEP.of(config).after == after


def test_sleep_after_zero_is_an_error_with_its_line() -> None:
    with pytest.raises(ConfigError, match=r":2.*sleep.after must be more than 0s, or off"):
        built_ins.parse("sleep:\n  after: 0s\n")


def test_sleep_without_the_slot_built_ins_warns_that_wakes_prefill() -> None:
    assert any("each wake prefills" in w for w in built_ins.warnings(built_ins.parse("sleep: {after: 1m}\n")))


async def test_an_asked_sleep_is_answered_once_it_happened() -> None:
    sleep = Sleep()
    first, second = sleep.ask("asked"), sleep.ask("asked again")
    assert sleep.asked.is_set() and sleep.asked_why == "asked again"
    sleep.answer({"asleep": True})
    assert (await first, await second) == ({"asleep": True}, {"asleep": True})


CONFIG = """
sleep: {{after: 1s}}
hooks:
  on_will_start:
    - shell: echo will_start sleep=$LLAMA_WRAPPER_SLEEP >> {log}
  on_startup:
    - shell: echo startup {{{{ sleep }}}} >> {log}
  on_will_stop:
    - shell: echo will_stop {{{{ sleep }}}} >> {log}
  on_stopped:
    - shell: echo stopped sleep=$LLAMA_WRAPPER_SLEEP >> {log}
"""


def test_a_sleep_and_a_wake_run_the_stop_and_start_hooks_with_sleep_said(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    wrapper = Wrapper(tmp_path, child_argv(), CONFIG.format(log=log))
    try:
        wrapper.wait_ready(60)
        pid = wrapper.status()["server"]["pid"]
        wait_for(lambda: wrapper.status()["state"] == "asleep", 30, "the wrapper to fall asleep")
        assert wrapper.health() == 200 and wrapper.status()["server"]["pid"] is None
        code, _, props = http("GET", f"{wrapper.url}/props")  # remembered: the child is not started for it
        assert code == 200 and json.loads(props) and wrapper.status()["state"] == "asleep"
        assert http("GET", f"{wrapper.url}/echo")[0] == 200  # a request that needs the server wakes it
        assert wrapper.status()["server"]["pid"] not in (None, pid)
        assert log.read_text().split("\n")[:6] == [
            "will_start sleep=", "startup False", "will_stop True", "stopped sleep=1", "will_start sleep=1",
            "startup True"]
        assert wrapper.stop() == 0
    finally:
        wrapper.kill()


SLOW_WAKE = """
sleep: {{after: 1s}}
hooks:
  on_will_start:
    - shell: "test -e {marker} && sleep 5 || touch {marker}"
"""


def test_a_stop_during_a_wake_ends_it_and_leaves_no_server(tmp_path: Path) -> None:
    """The first start touches the marker; the wake's on_will_start finds it and takes 5 s: a SIGTERM then."""
    wrapper = Wrapper(tmp_path, child_argv(), SLOW_WAKE.format(marker=tmp_path / "started"))
    try:
        wrapper.wait_ready(60)
        wait_for(lambda: wrapper.status()["state"] == "asleep", 30, "the wrapper to fall asleep")
        asking = Asked(wrapper.url, "/echo", {"hello": 1}).start()
        wait_for(lambda: wrapper.status()["state"] == "waking", 30, "the wake to begin")
        assert wrapper.stop() == 0
        asking.join(30)
        assert asking.status == 503, asking.raw  # refused at the stop, not left hanging
        spawned = wrapper.events("child.spawned")
        assert len(spawned) == 1  # the wake was ended before it started a server
        (stopped,) = wrapper.events("wrapper.stopped")
        assert stopped["exit_status"] == 0
    finally:
        wrapper.kill()


@pytest.mark.parametrize(("ready", "asked", "after", "idle_s", "why"), [
    (True, None, None, 9999.0, None),  # sleep.after off: only when asked
    (True, None, 60.0, 59.9, None),
    (True, None, 60.0, 60.0, "idle for sleep.after (60s)"),
    (True, "asked (POST /wrapper/sleep)", 60.0, 0.0, "asked (POST /wrapper/sleep)"),  # an ask needs no idleness
    (False, "asked (POST /wrapper/sleep)", 60.0, 999.0, None),  # a reload or a restart runs: later
    (False, None, 60.0, 999.0, None),
])
def test_when_a_sleep_is_due(ready: bool, asked: str | None, after: float | None, idle_s: float,
                             why: str | None) -> None:
    assert why_sleep(ready, asked, after, idle_s) == why
