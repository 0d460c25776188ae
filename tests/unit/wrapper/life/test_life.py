"""llama-server's life with no process: the reload entry (one at a time, only when ready, its answer kept and given
to on_reload), the watch that tells a server a reload replaces from one that died, a step that loses the server
reporting it, and the drain before a stop (the reloader and the hooks faked)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import pytest

from wrapper.actions import HookRun
from wrapper.configuration.config import Listen, parse_config
from wrapper.configuration.reload_plan import Refusal, ReloadRefused
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.life import server_life as life_module
from wrapper.life.hooks_running import Hooks
from wrapper.life.notify import Notifier
from wrapper.life.server_life import ServerLife
from wrapper.lifecycle import State
from wrapper.server.child import Child, Exit
from wrapper.server.generation import Generation, ServerLost, StartFailed
from wrapper.serving import Serving


class Server:
    """Stands for a llama-server process: it dies when told to (killed by a signal, as a crash is)."""

    def __init__(self) -> None:
        self.died = asyncio.Event()

    @property
    def alive(self) -> bool:
        return not self.died.is_set()

    async def wait(self) -> Exit:
        await self.died.wait()
        return Exit(-9)


def server() -> Child:
    return cast(Child, Server())


def dies(child: Child | None) -> None:
    cast(Server, child).died.set()


class Reloader:
    """Stands for wrapper/life/reloader.py: `cycle` is the reload, run on what serves."""

    cycle: Callable[[ServerLife, dict[str, Any]], Any]

    def __init__(self, host: ServerLife) -> None:
        self.host = host

    def settle(self, body: dict[str, Any], why: str | None = None, asks: Any = None,
               cut: bool = True) -> dict[str, Any]:
        if body.get("refuse"):
            raise ReloadRefused("nothing to change", 409, Refusal.NOTHING_TO_CHANGE)
        return body

    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], await type(self).cycle(self.host, body))


@pytest.fixture
async def life(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ServerLife]:
    monkeypatch.setattr(life_module, "Reloader", Reloader)
    config = parse_config("", "t.yaml")
    launch = Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"),
                    env={})
    async with aiohttp.ClientSession() as session:
        made = ServerLife(Serving(config, launch, session, Kept()), Hooks(session), Notifier({}))
        made.current.child = server()
        yield made


def ready(life: ServerLife) -> None:
    life.serving.lifecycle.to(State.STARTING)
    life.serving.lifecycle.to(State.READY)


async def test_the_first_generation_exists_from_the_start(life: ServerLife) -> None:
    assert isinstance(life.current, Generation) and life.current.launch.argv == ["llama-server"]
    assert life.in_flight == 0 and life.last_reload is None


async def test_a_reload_only_when_ready_one_at_a_time_its_answer_kept_and_given_to_on_reload(
        life: ServerLife, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReloadRefused) as refused:
        await life.reload({"n_ctx": 4096})
    assert refused.value.reason is Refusal.NOT_READY
    ready(life)
    release = asyncio.Event()

    async def cycle(host: ServerLife, body: dict[str, Any]) -> dict[str, Any]:
        await release.wait()
        return {"success": True, **body}

    Reloader.cycle = cycle
    given: list[tuple[str, dict[str, Any] | None]] = []

    async def on_reload(hooks: Hooks, event: str, generation: Generation,
                        reload: dict[str, Any] | None = None) -> list[Any]:
        given.append((event, reload))
        return []

    monkeypatch.setattr(Hooks, "run", on_reload)
    first = asyncio.ensure_future(life.reload({"n_ctx": 4096}))
    await asyncio.sleep(0)
    with pytest.raises(ReloadRefused) as refused:
        await life.reload({"n_ctx": 8192})
    assert refused.value.reason is Refusal.BUSY
    release.set()
    assert await first == {"success": True, "n_ctx": 4096}
    assert life.last_reload == {"success": True, "n_ctx": 4096} and given == [("on_reload", life.last_reload)]
    with pytest.raises(ReloadRefused) as refused:  # refused as it is settled: nothing is running then
        await life.reload({"refuse": True})
    assert refused.value.reason is Refusal.NOTHING_TO_CHANGE


async def test_a_server_a_reload_replaces_is_not_lost_and_the_one_after_it_is(life: ServerLife) -> None:
    ready(life)
    old = life.current

    async def cycle(host: ServerLife, body: dict[str, Any]) -> dict[str, Any]:
        new = host.new_generation(old.config, old.launch)
        new.child = server()
        host.install(new)
        dies(old.child)  # the old server stops once the new one serves
        return {"success": True}

    Reloader.cycle = cycle
    watching = asyncio.ensure_future(life.watch.lost())
    await asyncio.sleep(0)
    await life.reload({"n_ctx": 4096})
    for _ in range(20):
        await asyncio.sleep(0)
    assert not watching.done() and life.current is not old
    dies(life.current.child)
    await asyncio.wait_for(watching, 5)


async def test_a_reload_that_leaves_no_server_ends_the_watch(life: ServerLife) -> None:
    """The new server did not come up and neither did the previous one: what is current is dead."""
    ready(life)

    async def cycle(host: ServerLife, body: dict[str, Any]) -> dict[str, Any]:
        dies(host.current.child)
        raise StartFailed("llama-server exited with status 1 before it was ready")

    Reloader.cycle = cycle
    watching = asyncio.ensure_future(life.watch.lost())
    with pytest.raises(StartFailed):
        await life.reload({"n_ctx": 4096})
    await asyncio.wait_for(watching, 5)


async def test_a_stop_abandons_the_reload_that_runs(life: ServerLife) -> None:
    ready(life)
    began = asyncio.Event()

    async def cycle(host: ServerLife, body: dict[str, Any]) -> dict[str, Any]:
        began.set()
        await asyncio.Event().wait()
        raise AssertionError("never")

    Reloader.cycle = cycle
    asked = asyncio.ensure_future(life.reload({"n_ctx": 4096}))
    await asyncio.wait_for(began.wait(), 5)
    await life.abandon_reload()
    with pytest.raises(asyncio.CancelledError):
        await asked  # the listener answers 503 "the reload was abandoned"
    assert life.last_reload is None


async def test_a_step_that_loses_the_server_reports_it_once_and_goes_on_when_the_life_moved_on(
        life: ServerLife) -> None:
    ready(life)
    lost_one = life.current

    async def lost() -> bool:
        dies(lost_one.child)
        raise ServerLost("it died restoring")

    watching = asyncio.ensure_future(life.watch.lost())
    stepping = asyncio.ensure_future(life.survive(lost))
    found = await asyncio.wait_for(watching, 5)
    assert (found.reason, found.why) == ("restore", "it died restoring")  # the step's report, not a crash
    assert not stepping.done()  # the request waits until the wrapper no longer serves with the lost server
    life.serving.lifecycle.to(State.RESTARTING)
    assert await asyncio.wait_for(stepping, 5) is None


async def test_a_step_that_lost_a_server_a_reload_replaced_reports_nothing(life: ServerLife) -> None:
    ready(life)
    replaced = life.current

    async def lost() -> bool:
        new = life.new_generation(replaced.config, replaced.launch)
        new.child = server()
        life.install(new)  # a reload took over while the step ran
        raise ServerLost("it died restoring")

    assert await life.survive(lost) is None
    watching = asyncio.ensure_future(life.watch.lost())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not watching.done()  # the new server is well: nothing to report
    dies(life.current.child)
    assert (await asyncio.wait_for(watching, 5)).reason == "crash"


async def test_a_drain_only_when_ready_once_however_often_asked_and_the_stop_then_saves_nothing(
        life: ServerLife, monkeypatch: pytest.MonkeyPatch) -> None:
    saving = asyncio.Event()
    saves: list[str] = []

    async def on_will_stop(hooks: Hooks, event: str, generation: Generation, **_: Any) -> list[HookRun]:
        saves.append(event)
        await saving.wait()
        return [HookRun(event, "save", "shell", "ok", 0.1, 1)]

    monkeypatch.setattr(Hooks, "run", on_will_stop)
    with pytest.raises(ReloadRefused) as refused:
        await life.drain_before_stop(1.0)
    assert refused.value.reason is Refusal.NOT_READY and not await life._drain_settled()
    ready(life)
    asked = [asyncio.ensure_future(life.drain_before_stop(1.0)) for _ in range(2)]
    for _ in range(100):  # until the save runs
        if saves:
            break
        await asyncio.sleep(0)
    assert life.state is State.DRAINING
    stop = asyncio.ensure_future(life._drain_settled())  # a signal during the drain: the stop waits for it
    await asyncio.sleep(0)
    assert not stop.done()
    saving.set()
    first, second = await asyncio.gather(*asked)
    assert first == second and first["drained"] and first["on_will_stop"][0]["action"] == "save"
    assert saves == ["on_will_stop"] and await stop  # saved once: the stop has nothing left to save
