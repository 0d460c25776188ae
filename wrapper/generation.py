"""What the built-in hooks may use of the running wrapper: one generation's config, launch, client and child."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from wrapper.child import Child
from wrapper.config import Config
from wrapper.launch import Launch
from wrapper.llama import LlamaClient


class ServerLost(Exception):
    """llama-server died under a built-in's step (a restore it could not survive). The built-in has set aside
    what caused it; the wrapper starts the generation's server again instead of failing."""


class Host(Protocol):
    """What built-ins may ask of the wrapper around them (the supervisor)."""

    @property
    def current(self) -> Generation:
        """The generation that serves now (a reload replaces it)."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests being served now."""
        ...

    async def reload(self, body: dict[str, Any], why: str | None = None) -> dict[str, Any]:
        """A reload as POST /wrapper/reload asks for it; with `why` and an empty body, the built-ins' own argv
        changes (their fit for the new generation) are the whole change. Raises ReloadRefused."""
        ...


@dataclass
class Generation:
    config: Config
    launch: Launch
    client: LlamaClient
    child: Child | None = None
    state: dict[str, Any] = field(default_factory=dict)  # each built-in's own, for this generation
    shared: dict[str, Any] = field(default_factory=dict)  # each built-in's own, for the wrapper's whole life
    host: Host | None = None
