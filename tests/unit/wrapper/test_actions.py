"""Each action kind against real parts: a local aiohttp server, /bin/sh, real processes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web

from tests.helpers import free_port, pid_alive, wait_for
from wrapper.actions import HookFailed, HookRunner
from wrapper.configuration.config import Action, Listen, parse_config
from wrapper.configuration.hook_context import build, environment
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model


def context(**overrides: Any) -> dict[str, Any]:
    launch = Launch(argv=["x"], port=1, listen=Listen("127.0.0.1", 8080), model=Model("/m/a b.gguf", "a b", "abc123"),
                    env={})
    base: dict[str, Any] = {**build("on_startup", launch, pid=4242), "env": {}}
    base.update(overrides)
    return base


def actions(yaml_hook: str) -> tuple[Action, ...]:
    return parse_config(f"hooks:\n  on_startup:\n{yaml_hook}", "t.yaml").hooks["on_startup"]


class Peer:
    """A real HTTP server that records what it was sent and fails on demand."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.failures_left = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append({"method": request.method, "path": request.path, "headers": dict(request.headers),
                          "body": await request.text()})
        if self.failures_left:
            self.failures_left -= 1
            return web.Response(status=500, text="boom")
        if request.path == "/slow":
            await __import__("asyncio").sleep(5)
        return web.Response(status=201 if request.path == "/created" else 200, text="ok")


@pytest.fixture
async def peer() -> AsyncIterator[tuple[Peer, str]]:
    peer = Peer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", peer.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield peer, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def no_builtin() -> str | None:
    raise AssertionError("no built-in in these tests")


@pytest.fixture
async def runner() -> AsyncIterator[HookRunner]:
    async with aiohttp.ClientSession() as session:
        yield HookRunner(session, lambda name, options: no_builtin)


async def test_http_action_renders_url_headers_and_json(peer: tuple[Peer, str], runner: HookRunner) -> None:
    server, url = peer
    hook = actions(f"""
    - http:
        url: "{url}/hook/{{{{ model.id }}}}"
        headers: {{X-Model: "{{{{ model.name }}}}"}}
        json: {{event: "{{{{ event }}}}", pid: "{{{{ server.pid }}}}"}}
""")
    await runner.run("on_startup", hook, context())
    assert server.seen[0]["method"] == "POST" and server.seen[0]["path"] == "/hook/abc123"
    assert server.seen[0]["headers"]["X-Model"] == "a b"
    assert server.seen[0]["body"] == '{"event": "on_startup", "pid": "4242"}'


async def test_http_expect_and_retries(peer: tuple[Peer, str], runner: HookRunner) -> None:
    server, url = peer
    server.failures_left = 2
    await runner.run("on_startup", actions(f"    - http: {{url: '{url}/x'}}\n      retries: 2\n"), context())
    assert len(server.seen) == 3 and runner.history[-1].attempts == 3
    with pytest.raises(HookFailed, match="HTTP 200"):
        await runner.run("on_startup", actions(f"    - http: {{url: '{url}/x', expect: 204}}\n"), context())
    await runner.run("on_startup", actions(f"    - http: {{url: '{url}/created', expect: [201]}}\n"), context())


async def test_retries_are_bounded(peer: tuple[Peer, str], runner: HookRunner) -> None:
    server, url = peer
    server.failures_left = 10
    with pytest.raises(HookFailed, match="HTTP 500: boom"):
        await runner.run("on_startup", actions(f"    - http: {{url: '{url}/x'}}\n      retries: 1\n"), context())
    assert len(server.seen) == 2


async def test_http_timeout(peer: tuple[Peer, str], runner: HookRunner) -> None:
    _, url = peer
    with pytest.raises(HookFailed, match=r"timed out after 0\.2s"):
        await runner.run("on_startup", actions(f"    - http: {{url: '{url}/slow'}}\n      timeout: 200ms\n"), context())


async def test_shell_gets_environment_and_quoted_values(tmp_path: Path, runner: HookRunner) -> None:
    out = tmp_path / "out"
    hostile = "$(touch pwned); `touch pwned2`"
    line = "printf '%s|%s|%s|%s' {{ model.name }} \"$LLAMA_SERVER_PID\" \"$LLAMA_WRAPPER_EVENT\" {{ env.X }}"
    hook = actions(f"    - shell: {line} > {out}\n")
    await runner.run("on_startup", hook, context(model={"path": "p", "name": hostile, "id": "i"}, env={"X": "a b"}))
    assert out.read_text() == f"{hostile}|4242|on_startup|a b"
    assert not list(tmp_path.glob("pwned*")) and not os.path.exists("pwned")


async def test_a_chatty_hook_logs_its_first_and_last_lines_only(runner: HookRunner) -> None:
    """60 MB of output once made 789,474 hook.output events and delayed readiness by 10 s."""
    with structlog.testing.capture_logs() as captured:
        await runner.run("on_startup", actions("    - shell: seq 1 50000\n"), context())
    lines = [e["line"] for e in captured if e["event"] == "hook.output"]
    assert lines == [str(n) for n in (*range(1, 21), *range(49981, 50001))]
    dropped = [e for e in captured if e["event"] == "hook.output_dropped"]
    assert len(dropped) == 1 and dropped[0]["dropped"] == 50000 - 40


async def test_exec_gets_arguments_unsplit(tmp_path: Path, runner: HookRunner) -> None:
    out = tmp_path / "out"
    hook = actions(f"""    - exec: [/bin/sh, -c, 'printf "%s" "$1" > {out}', sh, "{{{{ model.path }}}}"]\n""")
    await runner.run("on_startup", hook, context())
    assert out.read_text() == "/m/a b.gguf"


async def test_failing_process_and_ignore_errors(runner: HookRunner) -> None:
    with pytest.raises(HookFailed, match="exit status 3"):
        await runner.run("on_startup", actions("    - shell: exit 3\n"), context())
    await runner.run("on_startup", actions("    - shell: exit 3\n      ignore_errors: true\n"), context())
    assert runner.history[-1].outcome == "ignored"
    with pytest.raises(HookFailed, match="cannot run"):
        await runner.run("on_startup", actions("    - exec: [/no/such/program]\n"), context())


async def test_timeout_kills_the_whole_process_group(tmp_path: Path, runner: HookRunner) -> None:
    pid_file = tmp_path / "pid"
    hook = actions(f"    - shell: sleep 60 & echo $! > {pid_file}; wait\n      timeout: 300ms\n")
    with pytest.raises(HookFailed, match="timed out"):
        await runner.run("on_startup", hook, context())
    grandchild = int(pid_file.read_text())
    wait_for(lambda: not pid_alive(grandchild), 5, "the hook's own child to be killed")


async def test_when_false_skips(runner: HookRunner) -> None:
    await runner.run("on_startup", actions("    - shell: exit 1\n      when: result == 'start-failed'\n"), context())
    assert runner.history[-1].outcome == "skipped"


async def test_a_value_missing_at_run_time_fails_the_action(runner: HookRunner) -> None:
    """Names are checked when the config is read; what a value holds only shows when the hook runs."""
    with pytest.raises(HookFailed, match="no element 3"):
        await runner.run("on_startup", actions("    - shell: echo {{ slots[3].id }}\n"), context())


async def test_every_run_is_one_log_event(runner: HookRunner) -> None:
    with structlog.testing.capture_logs() as captured:
        await runner.run("on_startup", actions("    - name: hello\n      shell: sleep 0.2; echo hi\n"), context())
    runs = [e for e in captured if e["event"] == "hook.run"]
    assert len(runs) == 1
    assert {k: runs[0][k] for k in ("hook", "action", "kind", "outcome")} == {
        "hook": "on_startup", "action": "hello", "kind": "shell", "outcome": "ok"}
    assert runs[0]["duration_ms"] >= 200  # the action's own time is in it: it slept that long at least
    assert [e["line"] for e in captured if e["event"] == "hook.output"] == ["hi"]


def test_environment_names() -> None:
    env = environment(context(result="success", exit_code=0))
    assert env["LLAMA_SERVER_URL"] == "http://127.0.0.1:1" and env["LLAMA_SERVER_PID"] == "4242"
    assert env["LLAMA_WRAPPER_RESULT"] == "success" and env["LLAMA_WRAPPER_EXIT_CODE"] == "0"
    assert env["LLAMA_WRAPPER_EXIT_SIGNAL"] == "" and env["LLAMA_MODEL_ID"] == "abc123"
