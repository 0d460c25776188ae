"""What serves, with no process: the reload entry (one at a time, only when ready, its answer kept and given to
on_reload), and the watch that tells a server a reload replaces from one that died (the reloader faked)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import aiohttp
import pytest

from wrapper import serving as serving_module
from wrapper.child import Child, Exit
from wrapper.config import Listen, parse_config
from wrapper.generation import Generation, ServerLost, StartFailed
from wrapper.hooks_running import Hooks
from wrapper.kept import Kept
from wrapper.launch import Launch
from wrapper.lifecycle import State
from wrapper.model import Model
from wrapper.notify import Notifier
from wrapper.reload_plan import Refusal, ReloadRefused
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
    """Stands for wrapper/reloader.py: `cycle` is the reload, run on what serves."""

    cycle: Callable[[Serving, dict[str, Any]], Any]

    def __init__(self, host: Serving) -> None:
        self.host = host

    def settle(self, body: dict[str, Any], why: str | None = None, asks: Any = None,
               cut: bool = True) -> dict[str, Any]:
        if body.get("refuse"):
            raise ReloadRefused("nothing to change", 409, Refusal.NOTHING_TO_CHANGE)
        return body

    async def run(self, body: dict[str, Any]) -> dict[str, Any]:
        return cast(dict[str, Any], await type(self).cycle(self.host, body))


@pytest.fixture
async def serving(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Serving]:
    monkeypatch.setattr(serving_module, "Reloader", Reloader)
    config = parse_config("", "t.yaml")
    launch = Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"),
                    env={})
    async with aiohttp.ClientSession() as session:
        hooks = Hooks(session)
        made = Serving(config, launch, session, Kept(), hooks, Notifier({}))
        made.current.child = server()
        yield made


def ready(serving: Serving) -> None:
    serving.lifecycle.to(State.STARTING)
    serving.lifecycle.to(State.READY)


async def test_the_first_generation_exists_from_the_start(serving: Serving) -> None:
    assert isinstance(serving.current, Generation) and serving.current.launch.argv == ["llama-server"]
    assert serving.in_flight == 0 and serving.last_reload is None


async def test_a_reload_only_when_ready_one_at_a_time_its_answer_kept_and_given_to_on_reload(
        serving: Serving, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ReloadRefused) as refused:
        await serving.reload({"n_ctx": 4096})
    assert refused.value.reason is Refusal.NOT_READY
    ready(serving)
    release = asyncio.Event()

    async def cycle(host: Serving, body: dict[str, Any]) -> dict[str, Any]:
        await release.wait()
        return {"success": True, **body}

    Reloader.cycle = cycle
    given: list[tuple[str, dict[str, Any] | None]] = []

    async def on_reload(hooks: Hooks, event: str, generation: Generation,
                        reload: dict[str, Any] | None = None) -> list[Any]:
        given.append((event, reload))
        return []

    monkeypatch.setattr(Hooks, "run", on_reload)
    first = asyncio.ensure_future(serving.reload({"n_ctx": 4096}))
    await asyncio.sleep(0)
    with pytest.raises(ReloadRefused) as refused:
        await serving.reload({"n_ctx": 8192})
    assert refused.value.reason is Refusal.BUSY
    release.set()
    assert await first == {"success": True, "n_ctx": 4096}
    assert serving.last_reload == {"success": True, "n_ctx": 4096} and given == [("on_reload", serving.last_reload)]
    with pytest.raises(ReloadRefused) as refused:  # refused as it is settled: nothing is running then
        await serving.reload({"refuse": True})
    assert refused.value.reason is Refusal.NOTHING_TO_CHANGE


async def test_a_server_a_reload_replaces_is_not_lost_and_the_one_after_it_is(serving: Serving) -> None:
    ready(serving)
    old = serving.current

    async def cycle(host: Serving, body: dict[str, Any]) -> dict[str, Any]:
        new = host.new_generation(old.config, old.launch)
        new.child = server()
        host.install(new)
        dies(old.child)  # the old server stops once the new one serves
        return {"success": True}

    Reloader.cycle = cycle
    watching = asyncio.ensure_future(serving.lost())
    await asyncio.sleep(0)
    await serving.reload({"n_ctx": 4096})
    for _ in range(20):
        await asyncio.sleep(0)
    assert not watching.done() and serving.current is not old
    dies(serving.current.child)
    await asyncio.wait_for(watching, 5)


async def test_a_reload_that_leaves_no_server_ends_the_watch(serving: Serving) -> None:
    """The new server did not come up and neither did the previous one: what is current is dead."""
    ready(serving)

    async def cycle(host: Serving, body: dict[str, Any]) -> dict[str, Any]:
        dies(host.current.child)
        raise StartFailed("llama-server exited with status 1 before it was ready")

    Reloader.cycle = cycle
    watching = asyncio.ensure_future(serving.lost())
    with pytest.raises(StartFailed):
        await serving.reload({"n_ctx": 4096})
    await asyncio.wait_for(watching, 5)


async def test_a_stop_abandons_the_reload_that_runs(serving: Serving) -> None:
    ready(serving)
    began = asyncio.Event()

    async def cycle(host: Serving, body: dict[str, Any]) -> dict[str, Any]:
        began.set()
        await asyncio.Event().wait()
        raise AssertionError("never")

    Reloader.cycle = cycle
    asked = asyncio.ensure_future(serving.reload({"n_ctx": 4096}))
    await asyncio.wait_for(began.wait(), 5)
    await serving.abandon_reload()
    with pytest.raises(asyncio.CancelledError):
        await asked  # the listener answers 503 "the reload was abandoned"
    assert serving.last_reload is None


class Alive:
    """Stands for a llama-server process that is running or not."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive


async def test_a_step_that_lost_the_server_starts_only_that_one_again_and_only_once(
        serving: Serving, monkeypatch: pytest.MonkeyPatch) -> None:
    ready(serving)
    started: list[str] = []

    async def started_again(why: str) -> dict[str, Any]:
        started.append(why)
        if why == "fails":
            serving._restart_failed = True
        return {}

    monkeypatch.setattr(serving, "_started_again", started_again)

    async def lost() -> bool:
        raise ServerLost("it died restoring")

    serving.current.child = cast(Child, Alive(True))  # a healthy server (another step started it again, or a
    assert await serving.survive(lost) is None and started == []  # reload replaced the one that died)
    serving.current.child = cast(Child, Alive(False))
    assert await serving.survive(lost) is None and started == ["it died restoring"]

    async def fails() -> bool:
        raise ServerLost("fails")

    started.clear()
    assert await serving.survive(fails) is None and started == ["fails"]
    assert await serving.survive(lost) is None and started == ["fails"]  # after a failed start: the wrapper stops
