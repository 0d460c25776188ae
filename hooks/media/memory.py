"""What the projector means to a memory move (degrade's, hooks/asks.py's MemoryMove): whether a move now would
give it up, and whether a move up would take it back. Degrade asks these here, never media's state."""

from __future__ import annotations

import time

from hooks.media.settings import MEDIA, on_demand
from hooks.media.state import STATE, MediaState
from wrapper.configuration.config import Config
from wrapper.kept import Kept


def gives_up(shared: Kept, config: Config) -> bool:
    """A memory move now would give the projector up (on demand, loaded, no request with media in flight)."""
    kept = shared.get(STATE)
    return on_demand(config) and kept.wanted and kept.in_flight == 0


def takes_back(shared: Kept, config: Config) -> bool:
    """A move up with `MemoryMove.projector` would take it back: it was given up for memory while media came
    within media.idle."""
    return took_back(shared.get(STATE), config)


def took_back(kept: MediaState, config: Config) -> bool:
    recent = kept.last_media_at is not None and time.monotonic() - kept.last_media_at < MEDIA.of(config).idle
    return kept.given_up and recent
