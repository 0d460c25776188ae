"""The real llama-swap for tests and benches: the pinned binary (`llama-swap/build-llama-swap`), run with the
recipe's config (examples/llama-swap.yaml, and the blocks docs/recipes/llama-swap.md adds to it) whose macros are
pointed at this machine's programs and models, on loopback ports of its own, in a home of its own (so the wrapper
configs' `~/.cache/llama-wrapper/...` folders are the test's), started and stopped by the test itself.

Its output is llama-swap's own lines (`[INFO] ...`) and, with the recipe's `logToStdout: both`, the wrappers' JSON
events, all in one file. It runs through the wrapper's trampoline, so the kernel kills it if the test process dies
(the death signal is tied to the thread that started it: start it from the main thread)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT, free_port, http, pid_alive, port_free, wait_for
from wrapper.server.child import TRAMPOLINE

BUILD = ROOT / "llama-swap" / "build-llama-swap"
EXAMPLE = ROOT / "examples" / "llama-swap.yaml"
WRAPPER_CONFIG = ROOT / "examples" / "chat.yaml"
RECIPE = ROOT / "docs" / "recipes" / "llama-swap.md"
NO_GO = 3  # build-llama-swap's status when it has nothing to make llama-swap with
DISCONNECTED = "upstream disconnection"  # llama-swap's "recovered from upstream disconnection during streaming"


class NoGo(RuntimeError):
    """Nothing to make llama-swap with: no LLAMA_SWAP, no cached build, no download, no Go toolchain."""


def find_binary() -> str:
    """The pinned llama-swap: LLAMA_SWAP, else the cache, else built (1-2 minutes)."""
    done = subprocess.run([str(BUILD)], capture_output=True, text=True, check=False, cwd=ROOT)
    if done.returncode == NO_GO:
        raise NoGo(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise RuntimeError(f"llama-swap/build-llama-swap failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip()


def binary() -> str:
    """find_binary() for a test: skipped, with the script's reason, only where there is nothing to build it with."""
    try:
        return find_binary()
    except NoGo as why:
        pytest.skip(str(why))


def recipe_block(first_line: str) -> Any:
    """The YAML block of the recipe that starts with `first_line`, parsed: what the recipe tells a user to add."""
    for block in re.findall(r"```yaml\n(.*?)```", RECIPE.read_text(), re.S):
        if block.startswith(first_line):
            return yaml.safe_load(block)
    raise AssertionError(f"no block of {RECIPE.name} starts with {first_line!r}")


def config(server_bin: str, chat_model: str, task_model: str, wrapper_config: Path = WRAPPER_CONFIG) -> dict[str, Any]:
    """examples/llama-swap.yaml with its macros pointed here: the venv's llama-wrapper, the pinned llama-server,
    the two models and the wrapper config. Everything else is the example's."""
    found: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    assert set(found["macros"]) == {"wrapper", "wrapper-config", "llama-server", "chat-model", "task-model"}
    found["macros"] = {"wrapper": str(Path(sys.executable).with_name("llama-wrapper")),
                       "wrapper-config": str(wrapper_config), "llama-server": server_bin,
                       "chat-model": chat_model, "task-model": task_model}
    return found


def expand(text: str, macros: dict[str, Any]) -> str:
    """`${name}` replaced as llama-swap replaces a config's macros (its ${PORT} and ${env.X} left alone)."""
    return re.sub(r"\$\{([a-zA-Z0-9_-]+)\}", lambda m: str(macros.get(m.group(1), m.group(0))), text)


def free_ports(count: int) -> int:
    """The first of `count` consecutive free loopback ports (llama-swap gives ${PORT} counting up from startPort,
    and checks none)."""
    while True:
        first = free_port()
        if all(port_free(first + i) for i in range(1, count)):
            return first


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (the wrappers, their llama-servers and trampolines)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


class LlamaSwap:
    """`llama-swap -config FILE -listen 127.0.0.1:PORT`, its models' ${PORT}s from a free startPort."""

    def __init__(self, tmp: Path, binary: str, settings: dict[str, Any]) -> None:
        self.tmp = tmp
        self.settings = copy.deepcopy(settings)
        models = sorted(m for m, c in self.settings["models"].items() if "${PORT}" in c["cmd"])
        start = free_ports(len(models))
        self.settings["startPort"] = start
        self.ports = {model: start + i for i, model in enumerate(models)}  # llama-swap's order: sorted ids
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = tmp / "home"
        self.home.mkdir(exist_ok=True)
        self.config_path = tmp / f"llama-swap-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        self.log_path = tmp / f"llama-swap-{self.port}.log"
        self.argv = [binary, "-config", str(self.config_path), "-listen", f"127.0.0.1:{self.port}"]
        self._process: subprocess.Popen[bytes] | None = None
        self._seen: set[int] = set()

    # -- its life ------------------------------------------------------------------------------------------------
    def start(self, timeout: float = 30) -> LlamaSwap:
        log = self.log_path.open("ab")
        trampoline = [sys.executable, "-I", "-S", TRAMPOLINE, str(os.getpid()), "exec"]  # dies with the test
        env = {**os.environ, "HOME": str(self.home)}
        env.pop("XDG_CACHE_HOME", None)  # the wrappers' ~/.cache is the test's home
        self._process = subprocess.Popen([*trampoline, *self.argv], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=self.tmp)
        log.close()
        wait_for(self._serving, timeout, "llama-swap to serve", interval=0.1)
        return self

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def _serving(self) -> bool:
        self.alive()
        try:
            return http("GET", f"{self.url}/health", timeout=2)[0] == 200
        except OSError:
            return False

    def alive(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise AssertionError(f"llama-swap exited {self._process.returncode}: {self.log()[-3000:]}")

    def processes(self) -> set[int]:
        """What runs below llama-swap now; remembered, so that a stop can check every one of them ended."""
        found = descendants(self.pid)
        self._seen |= found
        return found

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as a service manager stops it; its exit status."""
        assert self._process is not None
        self.processes()
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        return self._process.wait(timeout)

    def left_running(self) -> list[int]:
        """What ran below it and is still alive."""
        return sorted(pid for pid in self._seen if pid_alive(pid))

    def kill(self) -> None:
        """Whatever happened: llama-swap stopped (gracefully if it can), then anything it left, SIGKILLed."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self.processes()
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(45)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        for pid in self.left_running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LlamaSwap:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.kill()
        if kind is not None:
            print(f"--- {self.log_path}:\n{self.log()[-6000:]}")

    # -- what it says ---------------------------------------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The wrappers' JSON events on llama-swap's output (every model's, in order)."""
        found = []
        for line in self.log().splitlines():
            if not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict) and (name is None or event.get("event") == name):
                    found.append(event)
        return found

    def running(self) -> dict[str, str]:
        """GET /running: each model llama-swap has not stopped, and its state."""
        self.alive()
        listed = json.loads(http("GET", f"{self.url}/running")[2])["running"]
        return {entry["model"]: entry["state"] for entry in listed}

    def listed(self) -> dict[str, str]:
        """GET /v1/models: each model's status (loaded, unloaded)."""
        return {m["id"]: m["status"]["value"] for m in json.loads(http("GET", f"{self.url}/v1/models")[2])["data"]}

    # -- a model's wrapper, at its own address (a request through /upstream would load the model) -----------------
    def wrapper_url(self, model: str) -> str:
        return f"http://127.0.0.1:{self.ports[model]}"

    def status(self, model: str) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(http("GET", f"{self.wrapper_url(model)}/wrapper/status")[2])
        return found

    def server_pid(self, model: str) -> int:
        return int(self.status(model)["server"]["pid"])

    def wrapper_pid(self, model: str) -> int:
        """The wrapper is its llama-server's parent (the trampoline became llama-server)."""
        return parent_of(self.server_pid(model))

    # -- requests through llama-swap ------------------------------------------------------------------------------
    def chat(self, model: str, messages: list[dict[str, Any]], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
        status, _, raw = http("POST", f"{self.url}/v1/chat/completions",
                              {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                               **extra}, timeout=600)
        assert status == 200, raw[:600]
        answer: dict[str, Any] = json.loads(raw)
        return answer

    @contextlib.contextmanager
    def stream(self, model: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> Iterator[Stream]:
        """A streamed chat completion through llama-swap, read event by event; the connection is closed at the end
        of the block (a hang-up, if the stream has not ended)."""
        connection = HTTPConnection("127.0.0.1", self.port, timeout=600)
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                **extra}
        try:
            connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = connection.getresponse()
            assert reply.status == 200, reply.read()[:600]
            yield Stream(reply)
        finally:
            connection.close()


@dataclass
class Stream:
    """An event stream read line by line: each event's data, the content so far, how it ended."""

    reply: HTTPResponse
    events: list[str] = field(default_factory=list)
    text: str = ""
    finishes: int = 0
    done: int = 0  # `data: [DONE]` lines

    def next_content(self) -> bool:
        """Read until the next event that carries content; False at the end of the stream."""
        for raw in self.reply:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            self.events.append(data)
            if data == "[DONE]":
                self.done += 1
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise AssertionError(f"an error in the stream: {chunk}")
            for choice in chunk.get("choices", []):
                self.finishes += 1 if choice.get("finish_reason") else 0
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    self.text += piece
                    return True
        return False

    def read_to_end(self) -> None:
        while self.next_content():
            pass


@dataclass
class Conversation:
    """One conversation through llama-swap, turn after turn: how much of each turn's prompt came from the cache."""

    swap: LlamaSwap
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    reused: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)

    def turn(self, text: str, max_tokens: int = 16) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": text})
        began = time.monotonic()
        answer = self.swap.chat(self.model, self.messages, max_tokens=max_tokens)
        self.seconds.append(time.monotonic() - began)
        self.answers.append(answer)
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        timings = answer["timings"]
        self.reused.append(timings["cache_n"] / max(1, timings["cache_n"] + timings["prompt_n"]))
        return answer
