"""What built-ins may add to the path of a proxied request (wrapper/forwarding.py runs them), with typed
results: steps before a request is forwarded (the request to send, or a Reply for the client), growth when
llama-server answers a context overflow, what a GET of the server's description answers (Shown), and the
observers of responses (wrapper/proxy.py's Observer)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wrapper.config import Config
from wrapper.generation import Generation, Host
from wrapper.seats import Seat


@dataclass
class Outgoing:
    """A request about to be forwarded, its body read whole: a step may change the body it sends."""

    method: str
    path: str
    body: bytes
    payload: dict[str, Any] | None  # the body as a JSON object, when it is one
    after: list[Callable[[int | None], None]] = field(default_factory=list)  # the status, None if cut (or paused)
    seat: Seat | None = None  # its place in the slots' queue (a request that decodes): its class, its pauses
    keep: list[Callable[[], Awaitable[int]]] = field(default_factory=list)  # at a pause: keep what its slot holds
    # and let the slot go (the tokens kept); a request is paused only when a step can keep it


@dataclass(frozen=True)
class Reply:
    """A step's answer to the client instead of forwarding the request: this status and JSON body (an error
    is llama-server's shape: wrapper/proxy.py's error_body). Later steps do not run; `after` callbacks do."""

    status: int
    body: dict[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Before:
    """A step before forwarding: for POST requests to `paths`, given the request read whole. It returns the
    request to forward (changed or not), or a Reply for the client."""

    paths: tuple[str, ...]
    run: Callable[[Host, Outgoing], Awaitable[Outgoing | Reply]]


@dataclass(frozen=True)
class Shown:
    """What clients are told of the server: llama-server's JSON answer to a GET of one of `paths`, rewritten
    while `applies` (the media built-in: the modalities a projector loaded on demand will give)."""

    paths: tuple[str, ...]
    applies: Callable[[Generation], bool]
    rewrite: Callable[[Generation, str, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Grown:
    """The context now holds the request: send it again."""


@dataclass(frozen=True)
class CannotGrow:
    """No room can be made: the overflow stands, and the client is told why."""

    reason: str


@dataclass(frozen=True)
class NotPlanned:
    """There is no plan to grow with (no model file): the overflow stands as llama-server said it."""


GrowResult = Grown | CannotGrow | NotPlanned


@dataclass(frozen=True)
class Growth:
    """A built-in that grows the context for requests that overflow it (degrade)."""

    grow: Callable[[Host, int, bool], Awaitable[GrowResult]]  # tokens needed, the shared KV ran out
    continues: Callable[[Config], bool]  # answers cut by a full context go on after a growth
    headroom: Callable[[Config], int]  # tokens to allow beyond a prompt that asks for no max_tokens
