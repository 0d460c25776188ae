"""The media built-in's argv: with `media.projector: on_demand`, the user's `--mmproj` only while wanted.
Runs before degrade's fit, so the memory planner counts the projector only while it is loaded."""

from __future__ import annotations

from hooks.asks import MemoryMove, Projector, asked
from hooks.media.memory import took_back
from hooks.media.settings import on_demand
from hooks.media.state import STATE
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config
from wrapper.kept import Kept
from wrapper.launching.launch import Asks, Fitting, Launch


def fit(argv: list[str], launch: Launch, config: Config, shared: Kept, asks: Asks) -> Fitting:
    if not on_demand(config):
        return Fitting(list(argv))
    if not args.has(argv, args.MMPROJ):
        idle = Fitting(list(argv))
        idle.note("nothing (media.projector: on_demand)", "the argv names no --mmproj: there is no projector to "
                  "load, and a request with media gets the wrapper's 400")
        return idle
    kept = shared.get(STATE)
    own, memory = asked(asks, Projector), asked(asks, MemoryMove)
    if own is not None:
        kept.wanted, kept.given_up = own.wanted, False
    elif kept.wanted and memory is not None and not memory.up and kept.in_flight == 0:
        kept.wanted, kept.given_up = False, True  # a move for memory: an unused projector is given up first
        kept.decisions.made(change="given up", why="a memory move (degrade) and no request with media in flight")
    elif not kept.wanted and memory is not None and memory.projector and took_back(kept, config):
        kept.wanted, kept.given_up = True, False
        kept.decisions.made(change="taken back", why="memory is free again (degrade) after it was given up for it")
    if kept.wanted:
        return Fitting(list(argv), fitted=True)
    projector = args.get(argv, args.MMPROJ)
    done = Fitting(args.remove(argv, args.MMPROJ), fitted=False)
    done.note(f"--mmproj {projector} left out",
              "media.projector: on_demand: it is loaded (a reload) when the first request with an image or "
              "audio arrives, and dropped after media.idle without one, or at a memory move (degrade) while "
              "no request with media is in flight")
    return done


def warnings(config: Config) -> list[str]:
    if on_demand(config) and config.argv and not args.has(config.argv, args.MMPROJ):
        return ["media.projector: on_demand, but the server's argv names no --mmproj: there is nothing to load "
                "(a request with media gets the wrapper's 400); add --mmproj FILE"]
    return []
