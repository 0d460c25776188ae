"""The wrapper process end to end with a tiny real child: hooks order, signals, crashes, exit codes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import Wrapper, child_argv, free_port, http, pid_alive, wait_for
from wrapper.life.supervisor import SAME_SIGNAL_S

RECORD_HOOKS = """
hooks:
  on_will_start:
    - shell: echo will_start $LLAMA_WRAPPER_EVENT >> {log}
  on_startup:
    - shell: echo startup {{{{ server.pid }}}} $LLAMA_SERVER_PID >> {log}
  on_will_stop:
    - http: {{url: "{{{{ server.url }}}}/echo", json: {{event: "{{{{ event }}}}"}}}}
    - shell: echo will_stop >> {log}
  on_stopped:
    - shell: echo stopped {{{{ result }}}} {{{{ exit_code }}}} {{{{ exit_signal }}}} $LLAMA_WRAPPER_RESULT >> {log}
"""


def gated_hook(event: str, gate: Path) -> str:
    """A config whose `event` hook waits until the test creates `gate`."""
    return f"""
hooks:
  {event}:
    - shell: while [ ! -e {gate} ]; do sleep 0.05; done
      timeout: 30s
"""


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_hooks_run_in_order_and_group_sigterm_exits_zero(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    record = tmp_path / "requests.log"
    with Wrapper(tmp_path, child_argv("--record", str(record)), RECORD_HOOKS.format(log=log)) as wrapper:
        wrapper.wait_ready(30)
        pid = wrapper.status()["server"]["pid"]
        assert lines(log) == ["will_start on_will_start", f"startup {pid} {pid}"]
        wrapper.signal_group(signal.SIGTERM)
        assert wrapper.wait(30) == 0
    assert lines(log)[2:] == ["will_stop", "stopped success 0 None success"]
    assert "POST /echo" in lines(record)  # on_will_stop reached the live child
    assert not pid_alive(pid)
    hook_runs = [(e["hook"], e["outcome"]) for e in wrapper.events("hook.run")]
    assert hook_runs == [("on_will_start", "ok"), ("on_startup", "ok"), ("on_will_stop", "ok"),
                         ("on_will_stop", "ok"), ("on_stopped", "ok")]
    assert len(wrapper.events("wrapper.signal")) == 1


def test_child_gets_exactly_one_sigterm(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--term-delay", "0.5")) as wrapper:
        wrapper.wait_ready(30)
        assert wrapper.stop(30) == 0
    output = [e["line"] for e in wrapper.events("server.output")]
    assert sum("child: got SIGTERM" in line for line in output) == 1


def test_child_that_ignores_sigterm_is_killed_after_stop_timeout(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    config = f"""
server: {{stop_timeout: 1s}}
hooks:
  on_stopped:
    - shell: echo {{{{ result }}}} {{{{ exit_signal }}}} >> {log}
"""
    with Wrapper(tmp_path, child_argv("--ignore-term"), config) as wrapper:
        wrapper.wait_ready(30)
        pid = wrapper.status()["server"]["pid"]
        assert wrapper.stop(30) == 0
    assert lines(log) == ["timeout SIGKILL"]
    assert not pid_alive(pid)
    exited = wrapper.events("child.exited")[0]
    assert exited["killed_after_timeout"] is True


@pytest.mark.parametrize(("flags", "status", "result"), [
    (["--die-after", "0.5", "--exit-code", "7"], 7, "exit-code 7 None"),
    (["--die-after", "0.5", "--die-signal", "SIGSEGV"], 128 + signal.SIGSEGV, "signal None SIGSEGV"),
])
def test_child_that_dies_on_its_own(tmp_path: Path, flags: list[str], status: int, result: str) -> None:
    """Started again as long as the watchdog's budget lasts (2 in the window here); past it, the wrapper stops
    with the server's status."""
    log = tmp_path / "hooks.log"
    config = f"""
watchdog: {{restarts: 2}}
hooks:
  on_startup:
    - shell: echo started >> {log}
  on_will_stop:
    - shell: echo will_stop >> {log}
  on_stopped:
    - shell: echo {{{{ result }}}} {{{{ exit_code }}}} {{{{ exit_signal }}}} >> {log}
"""
    with Wrapper(tmp_path, child_argv(*flags), config) as wrapper:
        assert wrapper.wait(60) == status
    assert lines(log) == ["started"] * 3 + [result]  # no on_will_stop: the server was already gone
    restarted = wrapper.events("wrapper.restarting_server")
    assert [e["attempt"] for e in restarted] == [1, 2] and {e["on"] for e in restarted} == {"crash"}
    assert len(wrapper.events("wrapper.server_lost")) == 3 and wrapper.events("wrapper.giving_up")


def test_without_the_watchdog_a_child_that_dies_stops_the_wrapper(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--die-after", "0.5", "--exit-code", "7"), "watchdog: {enabled: false}\n") \
            as wrapper:
        assert wrapper.wait(30) == 7
    assert wrapper.events("wrapper.restarting_server") == []
    (given_up,) = wrapper.events("wrapper.giving_up")
    assert given_up["why"] == "watchdog.enabled is false"


def test_failing_start_hook_aborts_start_and_still_runs_on_stopped(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    config = f"""
hooks:
  on_startup:
    - name: hangs
      shell: sleep 30
      timeout: 300ms
  on_will_stop:
    - shell: echo will_stop >> {log}
  on_stopped:
    - shell: echo stopped {{{{ result }}}} >> {log}
"""
    with Wrapper(tmp_path, child_argv(), config) as wrapper:
        assert wrapper.wait(30) == 3
    assert lines(log) == ["stopped start-failed"]
    run = wrapper.events("hook.run")[0]
    assert (run["action"], run["outcome"]) == ("hangs", "failed")
    assert "timed out after 0.3s" in run["detail"]


def test_child_that_fails_to_start_exits_3(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--fail-start")) as wrapper:
        assert wrapper.wait(30) == 3
    failed = wrapper.events("wrapper.start_failed")[0]
    assert "exited with status 1 before it was ready" in failed["error"]
    assert "child: failing at start" in failed["error"]


def test_ready_timeout_fails_the_start(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--load-delay", "60"), "server: {ready_timeout: 1s}") as wrapper:
        assert wrapper.wait(30) == 3
    assert "ready_timeout" in wrapper.events("wrapper.start_failed")[0]["error"]


def test_requests_are_held_while_starting_and_health_is_503(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Wrapper(tmp_path, child_argv(), gated_hook("on_startup", gate)) as wrapper:
        wait_for(lambda: wrapper.health() == 503, 30, "/health 503 while starting")
        answers: list[int] = []
        thread = threading.Thread(target=lambda: answers.append(http("GET", f"{wrapper.url}/anything")[0]))
        thread.start()
        wait_for(lambda: wrapper.status()["requests"]["held"] == 1, 30, "the request to be held")
        assert answers == []
        gate.touch()
        thread.join(30)
        assert answers == [200]
        assert wrapper.health() == 200


def test_second_signal_skips_the_rest_of_the_hooks(tmp_path: Path) -> None:
    log = tmp_path / "hooks.log"
    config = f"""
hooks:
  on_will_stop:
    - shell: echo begin >> {log}; sleep 30
      timeout: 60s
  on_stopped:
    - shell: echo stopped >> {log}
"""
    with Wrapper(tmp_path, child_argv(), config) as wrapper:
        wrapper.wait_ready(30)
        pid = wrapper.status()["server"]["pid"]
        wrapper.signal_group()
        wait_for(lambda: lines(log) == ["begin"], 30, "on_will_stop to begin")
        time.sleep(SAME_SIGNAL_S * 2)  # a second Ctrl-C, not the first one delivered twice
        wrapper.signal_group()
        assert wrapper.wait(30) == 0
    assert lines(log) == ["begin"]
    assert not pid_alive(pid)
    assert [e["hook"] for e in wrapper.events("hook.skipped_by_second_signal")] == ["on_will_stop", "on_stopped"]


def test_one_signal_delivered_twice_is_one_stop_with_every_hook(tmp_path: Path) -> None:
    """`make demo` in a terminal's process group: a SIGTERM to the group reaches the wrapper, and make passes its own
    copy on microseconds later. That is one request to stop: the save still runs."""
    log = tmp_path / "hooks.log"
    config = (f"hooks:\n  on_will_stop:\n    - shell: echo saved >> {log}\n"
              f"  on_stopped:\n    - shell: echo stopped >> {log}\n")
    with Wrapper(tmp_path, child_argv(), config) as wrapper:
        wrapper.wait_ready(30)
        wrapper.signal_group()
        wrapper.process.send_signal(signal.SIGTERM)
        assert wrapper.wait(30) == 0
    assert lines(log) == ["saved", "stopped"]
    # the kernel may merge the two while the first is pending; either way one stop, counted once
    assert [e["count"] for e in wrapper.events("wrapper.signal")] == [1]


def test_sigkill_of_the_wrapper_takes_the_child_with_it(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--ignore-term")) as wrapper:
        wrapper.wait_ready(30)
        pid = wrapper.status()["server"]["pid"]
        wrapper.process.send_signal(signal.SIGKILL)  # the wrapper alone, not its group
        wrapper.wait(10)
        wait_for(lambda: not pid_alive(pid), 10, "the child to die with the wrapper")


def test_requests_get_503_with_retry_after_while_stopping(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Wrapper(tmp_path, child_argv(), gated_hook("on_will_stop", gate)) as wrapper:
        wrapper.wait_ready(30)
        wrapper.signal_group()
        wait_for(lambda: wrapper.health() == 503, 30, "/health 503 while stopping")
        status, headers, body = http("GET", f"{wrapper.url}/anything")
        assert status == 503 and headers.get("Retry-After") == "5"
        assert b"stopping" in body
        gate.touch()
        assert wrapper.wait(30) == 0


def test_a_closed_log_pipe_does_not_stop_the_stop(tmp_path: Path) -> None:
    """Ctrl-C on `make demo | tee log` kills tee first: logging into the dead pipe must not swallow the signal."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "wrapper.cli", "run", "--listen", f"127.0.0.1:{port}", "--log-format", "json",
         "--", *child_argv()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    assert process.stdout is not None
    try:
        for line in process.stdout:
            if b'"wrapper.ready"' in line:
                break
        pid = json.loads(http("GET", f"http://127.0.0.1:{port}/wrapper/status")[2])["server"]["pid"]
        process.stdout.close()  # the reader goes away
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        wait_for(lambda: not pid_alive(pid), 10, "the child to be stopped")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
