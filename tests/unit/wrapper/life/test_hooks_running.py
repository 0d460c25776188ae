"""Running hooks with no wrapper around them: the generation a built-in action is bound to, a failure in a
start hook, a second signal that cancels the hook that runs and skips the rest (built-ins faked: no process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import aiohttp
import pytest
import structlog

from wrapper import built_ins
from wrapper.actions import ActionError, BuiltinFn
from wrapper.configuration.config import Listen, parse_config
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.life.hooks_running import Hooks
from wrapper.server.generation import Generation, StartFailed
from wrapper.server.llama import LlamaClient


def generation(hooks_yaml: str, name: str = "a") -> Generation:
    config = parse_config(f"hooks:\n{hooks_yaml}", "t.yaml", built_ins.sections())
    launch = Launch(argv=["llama-server", "-c", "2048"], port=1, listen=Listen("127.0.0.1", 8080),
                    model=Model(None, name, name), env={})
    return Generation(config, launch, cast(LlamaClient, None))


@pytest.fixture
async def hooks() -> AsyncIterator[Hooks]:
    async with aiohttp.ClientSession() as session:
        yield Hooks(session)


class Builtins:
    """Stands for hooks/registry.py's actions: records what each is bound to; `work` is what it does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bound: list[tuple[str, Generation, Mapping[str, Any]]] = []
        self.started = asyncio.Event()
        self.work: Any = None
        monkeypatch.setattr(built_ins, "bind", self.bind)

    def bind(self, name: str, options: Mapping[str, Any], generation: Generation) -> BuiltinFn:
        self.bound.append((name, generation, options))

        async def run() -> str | None:
            self.started.set()
            if self.work is not None:
                await self.work()
            return f"{name} for {generation.launch.model.name}"

        return run


async def test_a_built_in_is_bound_to_the_generation_its_hook_runs_for(hooks: Hooks,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    builtins = Builtins(monkeypatch)
    first = generation("  on_will_stop: [{builtin: slots.save}]\n", "first")
    second = generation("  on_reload: [{builtin: slots.save, with: {n: '{{ reload.n_ctx }}'}}]\n", "second")
    done = await asyncio.gather(hooks.run("on_will_stop", first),
                                hooks.run("on_reload", second, reload={"n_ctx": 4096}))
    assert sorted((name, g.launch.model.name, dict(o)) for name, g, o in builtins.bound) == [
        ("slots.save", "first", {}), ("slots.save", "second", {"n": "4096"})]
    assert [[(r.hook, r.outcome, r.detail) for r in runs] for runs in done] == [
        [("on_will_stop", "ok", "slots.save for first")], [("on_reload", "ok", "slots.save for second")]]


async def test_a_failed_start_hook_aborts_the_start_and_a_failed_stop_hook_is_logged(
        hooks: Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    builtins = Builtins(monkeypatch)

    async def fails() -> None:
        raise ActionError("no room")

    builtins.work = fails
    failing = generation("  on_startup: [{builtin: slots.restore}]\n  on_will_stop: [{builtin: slots.save}]\n")
    with pytest.raises(StartFailed, match="no room"):
        await hooks.run("on_startup", failing)
    with structlog.testing.capture_logs() as logs:
        runs = await hooks.run("on_will_stop", failing)
    assert [r.outcome for r in runs] == ["failed"]
    assert [e["hook"] for e in logs if e["event"] == "hook.failed_during_stop"] == ["on_will_stop"]


async def test_a_second_signal_cancels_the_hook_that_runs_and_skips_every_one_after(
        hooks: Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    builtins = Builtins(monkeypatch)
    builtins.work = asyncio.Event().wait  # a save that would never end
    stopping = generation("  on_will_stop: [{builtin: slots.save}]\n  on_stopped: [{builtin: slots.save}]\n")
    with structlog.testing.capture_logs() as logs:
        saving = asyncio.ensure_future(hooks.run("on_will_stop", stopping))
        await asyncio.wait_for(builtins.started.wait(), 5)
        hooks.force()
        assert await asyncio.wait_for(saving, 5) == []
        assert await hooks.run("on_stopped", stopping) == []
    assert [e["hook"] for e in logs if e["event"] == "hook.skipped_by_second_signal"] == ["on_will_stop",
                                                                                           "on_stopped"]
    assert len(builtins.bound) == 1 and hooks.forced.is_set()  # on_stopped's built-in was never bound


async def test_a_hook_cancelled_from_outside_without_a_second_signal_is_cancelled(
        hooks: Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop cancels a reload (and its on_reload hook): that is no skip, the cancellation goes on up."""
    builtins = Builtins(monkeypatch)
    builtins.work = asyncio.Event().wait
    reloaded = asyncio.ensure_future(hooks.run("on_reload", generation("  on_reload: [{builtin: slots.save}]\n")))
    await asyncio.wait_for(builtins.started.wait(), 5)
    reloaded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reloaded
    assert not hooks.forced.is_set()


async def test_a_hook_returns_its_own_records_when_the_history_is_full(hooks: Hooks,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    Builtins(monkeypatch)
    saving = generation("  on_will_stop: [{builtin: slots.save}, {builtin: slots.save, name: again}]\n")
    for _ in range(30):
        runs = await hooks.run("on_will_stop", saving)
        assert [r.action for r in runs] == ["slots.save", "again"]
    assert len(hooks.history) == 50  # what the runner keeps
