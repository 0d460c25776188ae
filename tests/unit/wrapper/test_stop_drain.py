"""The drain before a stop, with no process: only when ready, asked twice it is one drain, and the stop learns
whether it has anything left to save (on_will_stop faked)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from wrapper.actions import HookRun
from wrapper.config import Listen, parse_config
from wrapper.generation import Generation
from wrapper.hooks_running import Hooks
from wrapper.kept import Kept
from wrapper.launch import Launch
from wrapper.lifecycle import State
from wrapper.model import Model
from wrapper.notify import Notifier
from wrapper.reload_plan import Refusal, ReloadRefused
from wrapper.serving import Serving
from wrapper.stop_drain import StopDrain


@pytest.fixture
async def parts() -> AsyncIterator[tuple[Serving, Hooks]]:
    launch = Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"),
                    env={})
    async with aiohttp.ClientSession() as session:
        hooks = Hooks(session)
        yield Serving(parse_config("", "t.yaml"), launch, session, Kept(), hooks, Notifier({})), hooks


async def test_a_drain_only_when_ready_once_however_often_asked_and_the_stop_then_saves_nothing(
        parts: tuple[Serving, Hooks], monkeypatch: pytest.MonkeyPatch) -> None:
    serving, hooks = parts
    saving = asyncio.Event()
    saves: list[str] = []

    async def on_will_stop(hooks: Hooks, event: str, generation: Generation, **_: Any) -> list[HookRun]:
        saves.append(event)
        await saving.wait()
        return [HookRun(event, "save", "shell", "ok", 0.1, 1)]

    monkeypatch.setattr(Hooks, "run", on_will_stop)
    drain = StopDrain(serving, hooks, Notifier({}))
    with pytest.raises(ReloadRefused) as refused:
        await drain.ask(1.0)
    assert refused.value.reason is Refusal.NOT_READY and not await drain.settled()
    serving.lifecycle.to(State.STARTING)
    serving.lifecycle.to(State.READY)
    asked = [asyncio.ensure_future(drain.ask(1.0)) for _ in range(2)]
    for _ in range(100):  # until the save runs
        if saves:
            break
        await asyncio.sleep(0)
    assert serving.lifecycle.state is State.DRAINING
    stop = asyncio.ensure_future(drain.settled())  # a signal during the drain: the stop waits for it
    await asyncio.sleep(0)
    assert not stop.done()
    saving.set()
    first, second = await asyncio.gather(*asked)
    assert first == second and first["drained"] and first["on_will_stop"][0]["action"] == "save"
    assert saves == ["on_will_stop"] and await stop  # saved once: the stop has nothing left to save
