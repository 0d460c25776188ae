"""Test helpers: run the real `llama-wrapper` as a process the way llama-swap does, and read its log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from wrapper.launching.launch import free_port as free_port  # re-exported for the tests

ROOT = Path(__file__).resolve().parent.parent
CHILD = str(ROOT / "tests" / "unit" / "child_server.py")


def chat_yaml(tmp_path: Path, more: str = "") -> str:
    """The README's llama-swap model config (`examples/chat.yaml`), as it is but for its folder (and what a test
    adds)."""
    text = (ROOT / "examples" / "chat.yaml").read_text()
    assert "~/.cache/llama-wrapper/slots" in text
    return text.replace("~/.cache/llama-wrapper/slots", str(tmp_path / "slots")) + more


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http(method: str, url: str, body: Any = None, timeout: float = 30.0,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, dict(reply.headers.items()), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """One chat completion at temperature 0 from the wrapper at `url`, asserted to be answered (200)."""
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}, timeout=600)
    assert status == 200, raw[:400]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def port_free(port: int) -> bool:
    """Whether nothing listens on `port` of loopback now."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


class Wrapper:
    """`llama-wrapper run` in its own process group (as llama-swap starts it), JSON logs to a file."""

    def __init__(self, tmp: Path, server_argv: list[str], config: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"wrapper-{self.port}.log"
        argv = [sys.executable, "-m", "wrapper.cli", "run", "--listen", f"127.0.0.1:{self.port}",
                "--log-format", "json", *(extra or [])]
        if config is not None:
            config_path = tmp / f"config-{self.port}.yaml"
            config_path.write_text(config)
            argv += ["--config", str(config_path)]
        argv += ["--", *server_argv]
        self.env = env or {}
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in wait()
        self.process = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            env={**os.environ, **(env or {})},
        )

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and (name is None or event.get("event") == name):
                out.append(event)
        return out

    def health(self) -> int:
        try:
            return http("GET", f"{self.url}/health", timeout=2)[0]
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 120.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"wrapper exited {self.process.returncode}: {self.log_path.read_text()[-3000:]}")
            return self.health() == 200
        wait_for(ready, timeout, "the wrapper's /health to say 200")

    def status(self) -> dict[str, Any]:
        """The status (with the admin token its environment gives: under consumers.isolate it is the admin's)."""
        token = self.env.get("LLAMA_WRAPPER_ADMIN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        result: dict[str, Any] = json.loads(http("GET", f"{self.url}/wrapper/status", headers=headers)[2])
        return result

    def signal_group(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """What llama-swap does to stop a model: the signal to the whole process group."""
        os.killpg(self.process.pid, sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.signal_group()
        return self.wait(timeout)

    def __enter__(self) -> Wrapper:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever happened in the body, nothing is left running (stop it in the body to check how it stops)."""
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self._log.close()


@contextlib.contextmanager
def running(tmp: Path, server_argv: list[str], config: str | None = None, timeout: float = 120.0,
            **options: Any) -> Iterator[Wrapper]:
    """A ready wrapper for the `with` body; killed afterwards whatever happened (stop it in the body to check
    how it stops)."""
    wrapper = Wrapper(tmp, server_argv, config, **options)
    try:
        wrapper.wait_ready(timeout)
        yield wrapper
    finally:
        wrapper.kill()


def peak_rss_kib(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def child_argv(*flags: str) -> list[str]:
    return [sys.executable, CHILD, *flags]
