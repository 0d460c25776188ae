"""The reload cycle against a small fake of what serves (the narrow ReloadHost) and generations whose
llama-server is a flag: no process, no llama-server."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

import pytest

from wrapper import built_ins
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, parse_config
from wrapper.configuration.reload_plan import Refusal, ReloadRefused
from wrapper.kept import Kept
from wrapper.launching.flags import planning
from wrapper.launching.launch import Launch
from wrapper.life.reloader import Reloader, carries_streams
from wrapper.lifecycle import Lifecycle, State
from wrapper.server.context import server_context
from wrapper.server.generation import Generation, StartFailed
from wrapper.server.llama import LlamaClient

T = TypeVar("T")

NO_CLIENT = cast(LlamaClient, None)  # the cycle asks nothing of a server that said its context at its start


def ctx(generation: Generation) -> str:
    return args.get(generation.launch.argv, args.CTX_SIZE) or "?"


@dataclass
class Server(Generation):
    """A generation whose llama-server starts (or fails to) and stops at once."""

    journal: list[str] = field(default_factory=list)
    fails: bool = False
    running: bool = False

    async def start(self, on_line: Callable[[Generation, str], None]) -> Any:
        self.journal.append(f"start {ctx(self)}")
        if self.fails:
            raise StartFailed("llama-server exited with status 1 before it was ready")
        self.running = True
        self.context = server_context(self.launch.argv, int(ctx(self)), 1, None)

    async def stop(self) -> None:
        if self.running:
            self.journal.append(f"stop {ctx(self)}")
        self.running = False

    @property
    def alive(self) -> bool:
        return self.running


class Serving:
    """Only what ReloadHost names: the current generation, a new one, hold, install, release, carry the streams,
    drain, and a step that survives a restore (the states it is asked for kept in a lifecycle)."""

    def __init__(self, config: Config, launch: Launch) -> None:
        self.journal: list[str] = []
        self.states: list[State] = []
        self.lifecycle = Lifecycle(self.states.append)
        self.lifecycle.to(State.STARTING)
        self.lifecycle.to(State.READY)
        self.states.clear()
        self.current: Generation = Server(config, launch, NO_CLIENT, journal=self.journal, running=True)
        self.current.context = server_context(launch.argv, int(ctx(self.current)), 1, None)
        self.failing: list[str] = []  # the -c of servers that will not come up
        self.draining: asyncio.Event | None = None  # a drain that lasts until it is set
        self.outlasting = False  # answers in flight outlast the drain's deadline

    def new_generation(self, config: Config, launch: Launch) -> Generation:
        return Server(config, launch, NO_CLIENT, journal=self.journal,
                      fails=args.get(launch.argv, args.CTX_SIZE) in self.failing)

    def install(self, generation: Generation) -> None:
        self.journal.append(f"install {ctx(generation)}")
        self.current = generation

    def hold(self) -> None:
        self.lifecycle.to(State.RELOADING)

    def release(self) -> None:
        self.lifecycle.to(State.READY)

    def carry_streams(self) -> int:
        self.journal.append("carry streams")
        return 0

    async def survived(self, generation: Generation, step: Callable[[], Awaitable[T]]) -> T:
        return await step()

    async def drain(self, timeout: float, cut: bool = True) -> bool:
        self.journal.append(f"drain {timeout:g}s" + ("" if cut else ", cutting none"))
        if self.draining is not None:
            await self.draining.wait()
        return cut or not self.outlasting


def serving(overlap: str = "never") -> Serving:
    config = parse_config(f"reload: {{overlap: {overlap}}}\n", "t.yaml", built_ins.sections())
    config = replace(config, argv=("llama-server-not-installed", "-c", "2048"))
    with planning():  # a llama-server that is not installed is taken for one with every flag
        return Serving(config, built_ins.launch_for(config, Kept()))


async def until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Let the loop run until `condition` holds (at most `turns` turns)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def reload(host: Serving, body: dict[str, Any]) -> dict[str, Any]:
    reloader = Reloader(host)
    with planning():
        nxt = reloader.settle(body)
    return await reloader.run(nxt)


async def test_a_reload_stops_the_old_server_starts_the_new_one_installs_it_and_answers() -> None:
    host = serving()
    answer = await reload(host, {"n_ctx": 4096})
    assert host.journal == ["drain 30s", "stop 2048", "start 4096", "install 4096"]
    assert host.states == [State.RELOADING, State.READY]
    assert answer["success"] and answer["message"].startswith("reloaded") and answer["n_ctx"] == 4096
    assert answer["changes"] == ["-c 2048 -> 4096"] and not answer["overlap"]
    assert not hasattr(host, "last_reload")  # the answer is returned, not written on the host


async def test_a_new_server_that_does_not_come_up_brings_the_previous_one_back() -> None:
    host = serving()
    host.failing = ["4096"]
    answer = await reload(host, {"n_ctx": 4096})
    assert host.journal == ["drain 30s", "stop 2048", "start 4096", "start 2048", "install 2048"]
    assert host.states == [State.RELOADING, State.READY] and ctx(host.current) == "2048" and host.current.alive
    assert not answer["success"] and answer["message"].startswith("reload failed, the previous settings are back")


async def test_when_the_previous_server_cannot_come_back_either_nothing_serves_and_the_reload_raises() -> None:
    host = serving()
    old = host.current
    host.failing = ["4096"]
    cast(Server, old).fails = True
    with pytest.raises(StartFailed):
        await reload(host, {"n_ctx": 4096})
    assert host.journal == ["drain 30s", "stop 2048", "start 4096", "start 2048"]
    assert host.current is old and not old.alive  # what the supervisor's watch sees: it stops the wrapper
    assert host.states == [State.RELOADING]


async def test_with_overlap_the_old_server_serves_until_the_new_one_is_up() -> None:
    host = serving("always")
    answer = await reload(host, {"n_ctx": 4096})
    assert host.journal == ["start 4096", "drain 30s", "install 4096", "stop 2048"]
    assert answer["success"] and answer["overlap"] and answer["overlap_why"] == "reload.overlap is always"


async def test_with_overlap_a_new_server_that_fails_disturbs_nothing() -> None:
    host = serving("always")
    host.failing = ["4096"]
    answer = await reload(host, {"n_ctx": 4096})
    assert host.journal == ["start 4096"] and host.states == []  # nothing held, nothing drained
    assert not answer["success"] and answer["downtime_ms"] == 0.0 and host.current.alive


async def test_a_reload_cancelled_while_it_drains_stops_the_new_server_and_leaves_the_old_one() -> None:
    """A SIGTERM during a reload: the new server that did not take over is stopped; the stop that follows
    saves what the old one holds."""
    host = serving("always")
    host.draining = asyncio.Event()
    old = host.current
    running = asyncio.ensure_future(reload(host, {"n_ctx": 4096}))
    await until(lambda: host.journal == ["start 4096", "drain 30s"])
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert host.journal == ["start 4096", "drain 30s", "stop 4096"]
    assert host.current is old and old.alive and host.states == [State.RELOADING]


async def test_nothing_to_change_is_refused_before_anything_stops() -> None:
    host = serving()
    with pytest.raises(ReloadRefused) as refused:
        await reload(host, {"n_ctx": 2048})
    assert refused.value.reason is Refusal.NOTHING_TO_CHANGE
    assert host.journal == [] and host.states == []


async def test_a_reload_that_cuts_nothing_is_given_up_when_answers_outlast_the_drain() -> None:
    host = serving()
    host.outlasting = True
    reloader = Reloader(host)
    with planning():
        nxt = replace(reloader.settle({"n_ctx": 4096}), cut=False)
    answer = await reloader.run(nxt)
    assert not answer["success"] and "this reload cuts none" in answer["message"]
    assert host.journal == ["drain 30s, cutting none"]  # nothing stopped, nothing started
    assert host.lifecycle.state is State.READY and ctx(host.current) == "2048"


@pytest.mark.parametrize(("keeps", "before", "after", "carried"), [
    ((True, True), ["-c", "4096"], ["-c", "8192"], True),  # a draft switch, a growth: every stream fits
    ((True, True), ["-c", "4096"], ["-c", "4096", "-ctk", "q8_0"], True),  # a rung's KV precision
    ((True, True), ["-c", "8192"], ["-c", "4096"], False),  # a smaller slot: a stream may not fit, it is waited for
    ((True, True), ["-c", "4096", "-np", "2"], ["-c", "8192", "-np", "3"], False),  # other slots
    ((True, True), ["-c", "4096", "-np", "2"], ["-c", "4096", "-np", "2", "-kvu"], False),  # another KV layout
    ((True, True), ["-c", "4096"], ["-c", "4096", "-np", "1"], False),  # automatic slots share one KV, -np 1 not
    ((True, True), ["-np", "2"], ["-np", "2"], False),  # no -c: what a slot holds is not known
    ((False, True), ["-c", "4096"], ["-c", "8192"], False),  # nothing carries the conversations across
    ((True, False), ["-c", "4096"], ["-c", "8192"], False),
    ((True, True), ["-c", "x"], ["-c", "8192"], False),
])
def test_which_reloads_hand_streams_over(keeps: tuple[bool, bool], before: list[str], after: list[str],
                                         carried: bool) -> None:
    assert carries_streams(*keeps, ["llama-server", *before], ["llama-server", *after]) is carried
