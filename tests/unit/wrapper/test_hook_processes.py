"""What a shell hook leaves behind: the deadline holds, leftovers end with the hook, nothing outlives the wrapper."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Wrapper, child_argv, pid_alive, running, wait_for


def read_pid(path: Path) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), 30, f"{path.name} to be written"))


@contextlib.contextmanager
def reaped(pid_file: Path) -> Iterator[None]:
    """Kill a test's stray process at the end, whatever the test found."""
    try:
        yield
    finally:
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_detached_job_holding_the_output_pipe_does_not_hold_the_start(tmp_path: Path) -> None:
    """`setsid sleep 25 & echo bg` once blocked the start for 26 s: the wrapper waited for the pipe, not the hook."""
    pid_file = tmp_path / "detached.pid"
    config = f"""
hooks:
  on_will_start:
    - shell: setsid sh -c 'echo $$ > {pid_file}; exec sleep 25' & echo bg
      timeout: 2s
"""
    with reaped(pid_file), running(tmp_path, child_argv(), config, timeout=60) as wrapper:
        detached = read_pid(pid_file)
        assert pid_alive(detached)  # ready while the job still holds the pipe: nobody waited for it
        (run,) = wrapper.events("hook.run")
        assert run["outcome"] == "ok" and run["detail"] == "exit status 0"
        assert "bg" in [e["line"] for e in wrapper.events("hook.output")]
        print(f"\nhook with a detached job holding its pipe took {run['duration_ms']} ms (deadline 2 s)")
        assert wrapper.stop() == 0
        assert not pid_alive(detached)  # the wrapper's stop ends what its hooks left running
        assert wrapper.events("hook.leftovers_ended")[0]["hooks"] == 1


def test_at_the_deadline_the_hooks_whole_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    config = f"""
hooks:
  on_will_start:
    - shell: sleep 30 & echo $! > {pid_file}; sleep 30
      timeout: 1s
      ignore_errors: true
"""
    with reaped(pid_file), running(tmp_path, child_argv(), config, timeout=60) as wrapper:
        (run,) = wrapper.events("hook.run")
        assert run["outcome"] == "ignored" and "timed out after 1s" in run["detail"]
        assert not pid_alive(read_pid(pid_file))


@pytest.mark.parametrize("kill_wrapper", [False, True])
def test_a_hooks_background_job_may_run_on_but_not_past_the_wrapper(tmp_path: Path, kill_wrapper: bool) -> None:
    pid_file = tmp_path / "job.pid"
    config = f"""
hooks:
  on_will_start:
    - shell: sleep 30 & echo $! > {pid_file}
"""
    with reaped(pid_file), running(tmp_path, child_argv(), config, timeout=60) as wrapper:
        job = read_pid(pid_file)
        assert pid_alive(job)
        if kill_wrapper:
            wrapper.process.send_signal(signal.SIGKILL)  # the wrapper alone: its guard still sees it go
            wrapper.wait(10)
        else:
            assert wrapper.stop() == 0
        wait_for(lambda: not pid_alive(job), 10, "the hook's background job to end with the wrapper")


def test_no_hook_process_outlives_a_sigkilled_wrapper(tmp_path: Path) -> None:
    pid_file = tmp_path / "job.pid"
    config = f"""
hooks:
  on_will_start:
    - shell: sleep 30 & echo $! > {pid_file}; sleep 30
      timeout: 60s
"""
    with reaped(pid_file), Wrapper(tmp_path, child_argv(), config) as wrapper:
        job = read_pid(pid_file)
        wrapper.process.send_signal(signal.SIGKILL)  # the wrapper alone, not its group
        wrapper.wait(10)
        wait_for(lambda: not pid_alive(job), 10, "the hook's background job to die with the wrapper")


def test_a_hook_that_leaves_nothing_running_is_not_reported_as_leftovers(tmp_path: Path) -> None:
    """`hook.leftovers_ended hooks=1` was logged at every stop, even for one `echo` in on_stopped."""
    config = """
hooks:
  on_will_stop: [{shell: echo a}]
  on_stopped: [{shell: echo b}]
"""
    with running(tmp_path, child_argv(), config, timeout=60) as wrapper:
        assert wrapper.stop() == 0
        assert [e["line"] for e in wrapper.events("hook.output")] == ["a", "b"]
        assert wrapper.events("hook.leftovers_ended") == []
