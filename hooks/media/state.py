"""What the media built-in keeps for the wrapper's life: whether the projector is wanted, when media was last
seen, the requests with media in flight, and its decisions; what the running server says it sees."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hooks.decisions import Decisions
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config
from wrapper.kept import Key
from wrapper.server.generation import Generation


@dataclass
class MediaState:
    wanted: bool = False  # with on_demand: the projector is in the argv of the next generations
    given_up: bool = False  # dropped for memory (a degrade move), not for idleness: a move up takes it back
    last_media_at: float | None = None  # time.monotonic() of the last request with media
    in_flight: int = 0  # requests with media being served now
    loads: int = 0
    drops: int = 0
    refused: int = 0
    modalities: dict[str, bool] = field(default_factory=dict)  # what the server said with the projector loaded
    markers: set[str] = field(default_factory=set)  # /props media_marker as clients were told it (each start
    # draws another: a /completion prompt written with an earlier one is given the current one)
    decisions: Decisions = field(default_factory=Decisions)

    def seen(self) -> None:
        self.last_media_at = time.monotonic()
        self.in_flight += 1

    def left(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.last_media_at = time.monotonic()  # the idle time counts from the end of the last one



STATE = Key("media", MediaState)


def state(generation: Generation) -> MediaState:
    return generation.shared.get(STATE)


def configured(config: Config) -> bool:
    """The user's argv names a projector."""
    return args.has(config.argv, args.MMPROJ)


def loaded(generation: Generation) -> bool:
    """The running server was started with the projector."""
    return args.has(generation.launch.argv, args.MMPROJ)
