"""A real router in front of wrappers for tests and benches: SMG (PyPI `smg`, the SGLang model gateway, a Rust
binary in a wheel), on loopback ports of its own, started and stopped by the test, with the policy and the session
headers the recipe (docs/recipes/router.md) gives. Its health checks run every second here (the recipe's 5 s), so
a host that drains or dies leaves the rotation within a look or two."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests import promtext
from tests.helpers import Wrapper, free_port, http, wait_for
from wrapper.server.child import TRAMPOLINE

INSTALL_HINT = "needs SGLang's model gateway: pip install 'smg>=1.13' (it is in the dev extra)"
SESSION_HEADER = "X-Session-Id"  # opencode's session header (docs/recipes/agents.md)


def smg_binary() -> str | None:
    """The `smg` of this environment (its scripts folder), else one on PATH."""
    beside = Path(sys.executable).with_name("smg")
    return str(beside) if beside.is_file() else shutil.which("smg")


def skip_without_smg() -> str:
    binary = smg_binary()
    if binary is None:
        pytest.skip(INSTALL_HINT)
    return binary


class Router:
    """`smg launch` over the given wrappers' URLs."""

    def __init__(self, tmp: Path, workers: list[str], policy: str, *extra: str, log_level: str = "warn") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.log_path = tmp / f"smg-{self.port}.log"
        self.argv = [skip_without_smg(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                     "--worker-urls", *workers, "--policy", policy,
                     "--routing-key-headers", SESSION_HEADER,
                     "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", log_level,
                     *extra]
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> Router:
        log = self.log_path.open("ab")
        trampoline = [sys.executable, "-I", "-S", TRAMPOLINE, str(os.getpid()), "exec"]  # dies with the test
        self._process = subprocess.Popen([*trampoline, *self.argv], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
        log.close()
        wait_for(lambda: len(self.healthy()) == len(self.workers), timeout, f"smg to register {self.workers}",
                 interval=0.2)
        return self

    def healthy(self) -> list[str]:
        """The worker URLs the router sends to now."""
        if self._process is not None and self._process.poll() is not None:
            raise AssertionError(f"smg exited {self._process.returncode}: {self.log_path.read_text()[-3000:]}")
        try:
            status, _, raw = http("GET", f"{self.url}/workers", timeout=5)
        except OSError:
            return []
        if status != 200:
            return []
        return [w["url"] for w in json.loads(raw)["workers"] if w.get("is_healthy")]

    def chat(self, session: str, body: dict[str, Any]) -> tuple[int, bytes]:
        status, _, raw = http("POST", f"{self.url}/v1/chat/completions", body, timeout=600,
                              headers={SESSION_HEADER: session})
        return status, raw

    def polled(self) -> dict[str, int]:
        """Each worker's load as SMG's own load monitor last read it from the worker's `GET /v1/loads` (its debug
        log's `update_dp_loads` line: the tokens the worker's KV holds), by URL; {} before its first read."""
        lines = self._reads()
        if not lines:
            return {}
        return {url: int(load) for url, load in re.findall(r'"(http://[^"]+)": \{0: (-?\d+)\}', lines[-1])}

    def reads(self) -> int:
        """How many times SMG's load monitor has read the workers' loads so far."""
        return len(self._reads())

    def _reads(self) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if "update_dp_loads" in line]

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
        if kind is not None:
            print(f"--- {self.log_path}:\n{self.log_path.read_text()[-4000:]}")


FILLER = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
SOURCES = ("slot", "folder", "bucket", "prefill")  # where a turn's KV came from


@dataclass(frozen=True)
class Seen:
    """What one host had done, as its /metrics and log tell: to find where a turn went and where its KV came from."""

    answered: float
    restores: int
    fetched: int


def seen(host: Wrapper) -> Seen:
    families = promtext.parse(http("GET", f"{host.url}/metrics")[2].decode())
    decisions = host.status()["slots"]["conversations"]["decisions"]
    return Seen(promtext.value(families, "llama_wrapper_requests_total", status_class="2xx"),
                sum(1 for d in decisions if d["choice"] == "restore"), len(host.events("store.fetched")))


@dataclass(frozen=True)
class Turn:
    reused: float  # the share of the conversation so far its answer took from the cache
    host: int  # the index of the host that answered it
    source: str  # slot (its KV was in the slot), folder, bucket (restored from there), prefill
    seconds: float


@dataclass
class Session:
    """One agent's conversation: its session header, its messages, turn after turn through the router."""

    name: str
    size: int = 25
    messages: list[dict[str, Any]] = field(default_factory=list)
    history: int = 0
    turns: list[Turn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "user", "content": f"Session {self.name}. " + FILLER * self.size}]

    def turn(self, router: Router, hosts: list[Wrapper | None]) -> Turn:
        before = [seen(h) if h is not None else None for h in hosts]
        began = time.monotonic()
        status, raw = router.chat(self.name, {"model": "demo", "messages": self.messages, "max_tokens": 8,
                                              "temperature": 0})
        took = time.monotonic() - began
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        reused = answer["timings"]["cache_n"] / self.history if self.history else 0.0
        self.history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        self.messages += [answer["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        after = [seen(h) if h is not None else None for h in hosts]
        (host,) = [i for i, (b, a) in enumerate(zip(before, after, strict=True))
                   if b is not None and a is not None and a.answered > b.answered]
        b, a = before[host], after[host]
        assert b is not None and a is not None
        source = ("bucket" if a.fetched > b.fetched else "folder") if a.restores > b.restores else \
            "slot" if reused >= 0.5 else "prefill"
        done = Turn(reused, host, source, took)
        self.turns.append(done)
        return done
