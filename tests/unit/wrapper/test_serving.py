"""What a request whose exchange was cut learns of its server (Serving.lost_under), with a real process playing the
server: lost and started again, lost for good, or well (another failure) — and a dead server is not reported as
serving again before the life has moved on from it, however late a busy machine runs the watch."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from wrapper.configuration.config import Listen, parse_config
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.lifecycle import State
from wrapper.server.child import spawn
from wrapper.serving import Loss, Serving

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture
async def serving() -> AsyncIterator[Serving]:
    launch = Launch(argv=SLEEPER, port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"), env={})
    async with aiohttp.ClientSession() as session:
        serving = Serving(parse_config("", "t.yaml"), launch, session, Kept())
        serving.lifecycle.to(State.STARTING)
        serving.lifecycle.to(State.READY)
        serving.current.child = await spawn(SLEEPER, None, lambda line: None)
        yield serving
        if serving.current.child is not None:
            serving.current.child.kill()
            await serving.current.child.wait()


async def _killed_then(serving: Serving, after_s: float, state: State) -> tuple[Loss, float]:
    """The server killed; the life moves to `state` `after_s` later: what lost_under said, and when."""
    generation = serving.current
    assert generation.child is not None
    generation.child.kill()

    async def life() -> None:
        await asyncio.sleep(after_s)
        serving.lifecycle.to(state)

    moving = asyncio.ensure_future(life())
    began = time.monotonic()
    loss = await serving.lost_under(generation, within=0.5)
    await moving
    return loss, time.monotonic() - began


async def test_a_dead_server_is_back_only_once_the_life_moved_on_from_it(serving: Serving) -> None:
    """The watch noticed the crash 3 s late (a busy machine): the request must not hear 'back' while the dead server
    still serves — its next pass would go there, a second loss, and the request be given up."""
    loss, after = await _killed_then(serving, 3.0, State.RESTARTING)
    assert loss is Loss.BACK and after >= 2.9, (loss, after)


async def test_a_server_that_is_well_was_not_lost(serving: Serving) -> None:
    assert await serving.lost_under(serving.current, within=0.2) is Loss.NONE  # alive, and nothing moved on


async def test_a_dead_server_not_started_again_is_gone(serving: Serving) -> None:
    assert (await _killed_then(serving, 0.2, State.STOPPING))[0] is Loss.GONE
