"""What built-ins may add to the path of a proxied request (wrapper/answers/forwarding.py runs them), with typed
results: steps before a request is forwarded (the request to send, or a Reply for the client; what it takes of a
slot, for the queue), growth when llama-server answers a context overflow, what a GET of the server's description
answers (Shown), and the observers of responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wrapper.asked import Asked
from wrapper.configuration.config import Config
from wrapper.server.generation import Generation, Host

Observer = Callable[[str, int, bytes], None]
"""Called with (path, status, the last bytes of the body) once a response has been passed on whole."""


LIMITS = ("max_completion_tokens", "max_tokens", "n_predict", "max_output_tokens")  # what it may generate, by API


def limit(request: dict[str, Any]) -> int | None:
    """What the request may generate, whichever key its API names it with."""
    for key in LIMITS:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """An error in llama-server's own shape, so clients parse it the same way."""
    return {"error": {"code": status, "message": message, "type": kind}}


@dataclass
class SlotUse:
    """What a request that decodes takes of a slot, as a step learns it: the queue (wrapper/queue/seats.py) reads it to
    say what a pause would cost, the step writes it."""

    slot: int | None = None  # the slot a step pinned it to, for the log and the status
    tokens: int = 0  # the tokens its request sends (after a pause: with what it goes on from), once a step counted
    prompt: int = 0  # its own request's prompt tokens (the first count; 0: not counted)
    counted: bool = False  # a step counted its prompt (or chose not to: then `prompt` stays 0)
    pauses: int = 0  # how often it was paused: more than 0, the request goes on from its own kept state


@dataclass
class Outgoing:
    """A request about to be forwarded, its body read whole: a step may change the body it sends."""

    method: str
    path: str
    body: bytes
    payload: dict[str, Any] | None  # the body as a JSON object, when it is one
    asked: Asked  # who asks, and how (made once, as the request arrived)
    after: list[Callable[[int | None], None]] = field(default_factory=list)  # the status, None if cut (or paused)
    use: SlotUse | None = None  # what it takes of a slot (a request that decodes, seated in the queue)
    keep: list[Callable[[], Awaitable[int]]] = field(default_factory=list)  # at a pause: keep what its slot holds
    # and let the slot go (the tokens kept); a request is paused only when a step can keep it


@dataclass(frozen=True)
class Reply:
    """A step's answer to the client instead of forwarding the request: this status and JSON body (an error
    is llama-server's shape: wrapper/answers/proxy.py's error_body). Later steps do not run; `after` callbacks do."""

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
