"""What built-ins add to the request path, with no process: a step may answer the client (Reply), and a
built-in asks for a reload in one way that waits for a reload that runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hooks.registry import Builtin
from wrapper import built_ins
from wrapper.answers.forwarding import forward_request
from wrapper.configuration.config import Listen, parse_config
from wrapper.configuration.reload_plan import BUSY_RELOADING, Refusal, ReloadRefused
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.life.hooks_running import Hooks
from wrapper.life.notify import Notifier
from wrapper.life.server_life import ServerLife
from wrapper.lifecycle import State
from wrapper.reload_ask import NotReloaded, Reloaded, RolledBack, Unchanged, ask_reload
from wrapper.server.generation import Generation, Host
from wrapper.serving import Serving
from wrapper.steps import Before, Outgoing, Reply

SEEN: list[int | None] = []


async def _answers_images(host: Host, out: Outgoing) -> Outgoing | Reply:
    out.after.append(SEEN.append)
    if out.payload is not None and out.payload.get("image"):
        return Reply(400, {"error": {"code": 400, "message": "no projector", "type": "invalid_request_error"}},
                     {"Retry-After": "1"})
    return out


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    step = Builtin(family="media", in_use=lambda config: True, before=(Before(("/completion",), _answers_images),))
    monkeypatch.setattr(built_ins, "BUILTINS", (step,))
    launch = Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"),
                    env={})
    async with aiohttp.ClientSession() as session:
        serving = Serving(parse_config("", "t.yaml"), launch, session, Kept())
        life = ServerLife(serving, Hooks(session), Notifier({}))
        serving.lifecycle.to(State.STARTING)
        serving.lifecycle.to(State.READY)

        async def handler(request: web.Request) -> web.StreamResponse:
            return await forward_request(request, serving, life, request.path)

        app = web.Application()
        app.router.add_post("/completion", handler)
        async with TestClient(TestServer(app)) as test_client:
            yield test_client


async def test_a_step_answers_the_client_and_its_after_callbacks_hear_the_status(
        client: TestClient[web.Request, web.Application]) -> None:
    SEEN.clear()
    reply = await client.post("/completion", data=json.dumps({"prompt": "hi", "image": "x"}))
    assert reply.status == 400 and reply.headers["Retry-After"] == "1"
    assert (await reply.json())["error"]["message"] == "no projector"
    assert SEEN == [400]


class Reloading:
    """Stands for what serves: refuses as busy `busy` times, then answers (or says nothing changes)."""

    def __init__(self, busy: int = 0, then: Exception | None = None) -> None:
        self.busy, self.then, self.asked = busy, then, cast(list[tuple[Any, ...]], [])
        self.current = cast(Generation, type("G", (), {"config": parse_config("", "t.yaml")})())

    async def reload(self, body: dict[str, Any], why: str | None = None,
                     asks: Mapping[type[Any], Any] | None = None, cut: bool = True) -> dict[str, Any]:
        self.asked.append((body, why, asks))
        if self.busy:
            self.busy -= 1
            raise ReloadRefused(BUSY_RELOADING, 409, Refusal.BUSY)
        if self.then is not None:
            raise self.then
        return {"success": True}


async def test_a_reload_asked_by_a_built_in_waits_for_the_one_that_runs() -> None:
    host = Reloading(busy=2)
    asked = await ask_reload(cast(Host, host), "media: an image", {bool: True})
    assert asked == Reloaded({"success": True})
    assert host.asked == [({}, "media: an image", {bool: True})] * 3


async def test_a_reload_that_changes_nothing_or_is_refused_says_so() -> None:
    nothing = Reloading(0, ReloadRefused("nothing to change", 400, Refusal.NOTHING_TO_CHANGE))
    assert await ask_reload(cast(Host, nothing), "x", body={"n_ctx": 4096}) == Unchanged("nothing to change")
    assert nothing.asked == [({"n_ctx": 4096}, "x", None)]
    still_busy = Reloading(busy=100)
    assert isinstance(await ask_reload(cast(Host, still_busy), "x", wait=0.3), NotReloaded)
    assert 2 <= len(still_busy.asked) <= 4


async def test_a_reload_that_rolled_back_is_its_own_outcome() -> None:
    class RollingBack(Reloading):
        async def reload(self, body: dict[str, Any], why: str | None = None,
                         asks: Mapping[type[Any], Any] | None = None, cut: bool = True) -> dict[str, Any]:
            await super().reload(body, why, asks, cut)
            return {"success": False, "message": "llama-server exited with status 1 before it was ready"}

    asked = await ask_reload(cast(Host, RollingBack()), "degrade: grow")
    assert isinstance(asked, RolledBack) and "exited with status 1" in asked.reason
