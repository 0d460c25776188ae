"""What a hook's templates see: one shape, declared once. The template check (wrapper/configuration/template.py), the
variables shell and exec actions get (wrapper/actions.py) and the hooks that run (wrapper/life/hooks_running.py) all
come from here."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol, TypedDict, get_type_hints


class ServerInfo(TypedDict):
    url: str
    host: str
    port: int
    pid: int | None
    argv: list[str]


class ListenInfo(TypedDict):
    url: str
    host: str
    port: int


class ModelInfo(TypedDict):
    path: str | None
    name: str
    id: str


class HookContext(TypedDict):
    event: str
    server: ServerInfo
    listen: ListenInfo
    model: ModelInfo
    slots: list[dict[str, Any]]
    result: str | None
    exit_code: int | None
    exit_signal: str | None
    reload: dict[str, Any] | None
    sleep: bool
    env: dict[str, str]


def _shape(kind: Any) -> frozenset[str] | None:
    return frozenset(get_type_hints(kind)) if isinstance(kind, type) and hasattr(kind, "__total__") else None


# The names a template may use, and the keys of those whose shape is fixed.
NAMES: dict[str, frozenset[str] | None] = {name: _shape(kind) for name, kind in get_type_hints(HookContext).items()}
# Names set only in some hooks (elsewhere they are None, and `reload.n_ctx` would fail the hook).
ONLY_IN = {"reload": ("on_reload",)}


class _Address(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...


class _Model(Protocol):
    def as_dict(self) -> dict[str, str | None]: ...


class _Launch(_Address, Protocol):
    """What the context needs of a launch (wrapper/launching/launch.py, which this module may not import): its address,
    argv, listen address and model."""

    @property
    def argv(self) -> list[str]: ...
    @property
    def listen(self) -> _Address: ...
    @property
    def model(self) -> _Model: ...


class _Ended(Protocol):
    """How llama-server ended (wrapper/server/child.py's Exit, which this module may not import)."""

    @property
    def code(self) -> int | None: ...
    @property
    def signal_name(self) -> str | None: ...


def build(event: str, launch: _Launch, pid: int | None, slots: list[dict[str, Any]] | None = None,
          result: str | None = None, finished: _Ended | None = None,
          reload: dict[str, Any] | None = None, sleep: bool = False) -> HookContext:
    model = launch.model.as_dict()
    return {
        "event": event,
        "server": {"url": launch.url, "host": launch.host, "port": launch.port, "pid": pid,
                   "argv": list(launch.argv)},
        "listen": {"url": launch.listen.url, "host": launch.listen.host, "port": launch.listen.port},
        "model": {"path": model.get("path"), "name": str(model.get("name")), "id": str(model.get("id"))},
        "slots": slots or [],
        "result": result,
        "exit_code": finished.code if finished else None,
        "exit_signal": finished.signal_name if finished else None,
        "reload": reload,
        "sleep": sleep,
        "env": dict(os.environ),
    }


def environment(context: Mapping[str, Any]) -> dict[str, str]:
    """The LLAMA_* variables shell and exec actions get."""
    server, listen, model = context["server"], context["listen"], context["model"]
    pairs = {
        "LLAMA_WRAPPER_EVENT": context["event"],
        "LLAMA_WRAPPER_RESULT": context["result"],
        "LLAMA_WRAPPER_SLEEP": "1" if context["sleep"] else "",
        "LLAMA_WRAPPER_EXIT_CODE": context["exit_code"],
        "LLAMA_WRAPPER_EXIT_SIGNAL": context["exit_signal"],
        "LLAMA_WRAPPER_URL": listen["url"],
        "LLAMA_SERVER_URL": server["url"],
        "LLAMA_SERVER_HOST": server["host"],
        "LLAMA_SERVER_PORT": server["port"],
        "LLAMA_SERVER_PID": server["pid"],
        "LLAMA_MODEL_PATH": model["path"],
        "LLAMA_MODEL_NAME": model["name"],
        "LLAMA_MODEL_ID": model["id"],
    }
    return {key: "" if value is None else str(value) for key, value in pairs.items()}
