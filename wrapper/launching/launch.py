"""From a config to the exact child command line: private port, model identity, persistence flags."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from wrapper.configuration import argv as args
from wrapper.configuration.auth import AdminToken, redacted, server_keys
from wrapper.configuration.config import Config, ConfigError, Listen
from wrapper.launching.flags import is_planning, supported_flags
from wrapper.launching.gguf_meta import GGUFError, architecture_facts, read_metadata
from wrapper.launching.model import Model, from_argv

log = structlog.get_logger()

PRIVATE_HOST = "127.0.0.1"
DEFAULT_LISTEN = Listen("127.0.0.1", 8080)  # llama-server's own default, so the wrapper is a drop-in


Asks = Mapping[type[Any], Any]  # what a move asks the next generation's fits for, each ask under its type
# (the built-ins declare theirs in hooks/asks.py; the wrapper passes them on unread)


@dataclass
class Fitting:
    """What a built-in changed in the child's argv, why, and what it set up for the generation."""

    argv: list[str]
    notes: list[dict[str, str]] = field(default_factory=list)
    fitted: Any = None  # kept in `Launch.fitted[family]`
    keep_saved: str | None = None  # why saves should keep the slot files there are (they would be worse now)

    def note(self, change: str, why: str) -> None:
        self.notes.append({"change": change, "why": why})


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    port: int
    listen: Listen
    model: Model
    env: dict[str, str]
    keys: tuple[str, ...] = ()  # llama-server's API keys: our own calls send the first, our endpoints ask for one
    fitted: dict[str, Any] = field(default_factory=dict)  # what each built-in's fit set up for it (slots: a folder)
    admin: AdminToken = field(default_factory=lambda: AdminToken(None, {}))  # what POST /wrapper/* asks for
    read_token_file: Path | None = None  # admin.read_token_file: what reads the status and /metrics alone
    metrics: bool = False  # llama-server serves /metrics (GET /metrics passes it through)
    keep_saved: str | None = None  # a built-in's fit made saves worse than the files there are: keep them (why)
    notes: list[dict[str, str]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # what the GGUF header says, when it was read

    @property
    def host(self) -> str:
        return PRIVATE_HOST

    @property
    def url(self) -> str:
        return f"http://{PRIVATE_HOST}:{self.port}"

    @property
    def api_key(self) -> str | None:
        return self.keys[0] if self.keys else None

    @property
    def shown_argv(self) -> list[str]:
        """The argv as status and logs show it: secrets redacted."""
        return redacted(self.argv)


def free_port(host: str = PRIVATE_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def prepare(config: Config) -> Launch:
    """Check the command and rewrite it; raises ConfigError before anything is spawned."""
    argv = list(config.argv)
    if not argv:
        raise ConfigError("nothing to run: put the llama-server command after `--`, or set server.argv")
    if shutil.which(argv[0]) is None and not is_planning():  # a plan needs no server
        raise ConfigError(
            f"{argv[0]!r} is not an executable or not on PATH "
            "(build the pinned one with llama.cpp/build-server, or give the full path to your own)"
        )
    notes: list[dict[str, str]] = []
    user_host, user_port = args.get(argv, args.HOST), args.get(argv, args.PORT)
    listen = config.listen
    if listen is None:
        listen = _listen_from_server_args(user_host, user_port)
    if user_host is not None or user_port is not None:
        notes.append({"change": f"removed --host/--port ({user_host or '-'}:{user_port or '-'})",
                      "why": f"llama-server listens privately; the wrapper serves {listen.url}"})
    port = free_port()
    while port == listen.port:  # not bound yet when we pick: the kernel may offer the public port again
        port = free_port()
    argv = [*args.remove(args.remove(argv, args.HOST), args.PORT), "--host", PRIVATE_HOST, "--port", str(port)]
    flags = supported_flags(argv[0])
    metrics = args.has(argv, args.METRICS)
    if not metrics and flags is not None and args.METRICS[0] in flags:
        argv.append(args.METRICS[0])
        metrics = True
        notes.append({"change": "--metrics", "why": "GET /metrics on the wrapper passes llama-server's own "
                      "metrics through, followed by the wrapper's; llama-server's port stays private"})
    model = from_argv(argv)
    if model.path and not os.path.isfile(model.path):
        raise ConfigError(f"the model file {model.path!r} (-m) does not exist: give the path of a .gguf file "
                          "(in a clone of llama-wrapper, `make model` prints the demo model's)")
    if model.path and (magic := _magic(model.path)) != b"GGUF":
        raise ConfigError(f"the model file {model.path!r} (-m) is not a GGUF file (it starts with {magic!r}, not "
                          "b'GGUF'): give the path of a .gguf model, not a folder, a download page or a sidecar")
    env = {**os.environ, **config.env}
    facts: dict[str, Any] = {}
    if model.path:
        try:
            facts = architecture_facts(read_metadata(model.path))
        except GGUFError as exc:
            notes.append({"change": "could not read the model's GGUF header",
                          "why": f"{exc}; SWA detection, the -c default and memory plans are off"})
    return Launch(argv=argv, port=port, listen=listen, model=model, env=env, keys=server_keys(argv, env),
                  admin=AdminToken(config.admin_token_file, os.environ), read_token_file=config.read_token_file,
                  metrics=metrics, notes=notes, facts=facts)


def _magic(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(4)
    except OSError as exc:
        raise ConfigError(f"the model file {path!r} (-m) cannot be read: {exc.strerror}") from exc


def _listen_from_server_args(host: str | None, port: str | None) -> Listen:
    """Where the wrapper listens when only llama-server's own --host/--port say it."""
    if port is None or port.strip() == "0":
        return Listen(host or DEFAULT_LISTEN.host, DEFAULT_LISTEN.port)
    if not port.strip().isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"llama-server's --port {port!r} is not a port (1-65535); "
                          "fix it, or give the wrapper its own address with --listen HOST:PORT")
    return Listen(host or DEFAULT_LISTEN.host, int(port))


# -- the context llama-server runs with ---------------------------------------------------------------------
