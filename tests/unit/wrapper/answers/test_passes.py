"""The steps run on the server they talk to: a pass that would go to another server than the one its steps ran on (a
crash's restart, a reload's hand-over, a growth) runs them again there first — no server answers here (the pass
itself is refused a connection), what is checked is which server each run of the steps saw and what it was given."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import make_mocked_request

from wrapper.answers.passes import Passes
from wrapper.answers.proxy import Outcome
from wrapper.answers.route import Shape
from wrapper.asked import Asked
from wrapper.configuration.config import Listen, parse_config
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.lifecycle import State
from wrapper.server.generation import Generation, Host
from wrapper.serving import Serving
from wrapper.steps import Before, Outgoing

PATH = "/completion"


class Pinning:
    """A step that pins every request to slot 3 and says which server each of its runs saw and what it was given."""

    def __init__(self) -> None:
        self.runs: list[tuple[Generation, dict[str, Any]]] = []
        self.told: list[int | None] = []
        self.asked: list[Asked] = []  # who asked, as each run was told

    async def run(self, host: Host, out: Outgoing) -> Outgoing:
        assert out.payload is not None
        self.runs.append((host.current, dict(out.payload)))
        self.asked.append(out.asked)
        out.payload["id_slot"] = 3
        out.body = json.dumps(out.payload).encode()
        out.after.append(self.told.append)
        return out


@pytest.fixture
async def serving() -> AsyncIterator[Serving]:
    launch = Launch(argv=["llama-server"], port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"),
                    env={})  # nothing listens on port 1: a pass is refused a connection (CUT)
    async with aiohttp.ClientSession() as session:
        serving = Serving(parse_config("", "t.yaml"), launch, session, Kept())
        serving.lifecycle.to(State.STARTING)
        serving.lifecycle.to(State.READY)
        yield serving


def _host(serving: Serving) -> Host:
    class _Host:
        @property
        def current(self) -> Generation:
            return serving.current
    return _Host()  # type: ignore[return-value]  # the step reads only what serves


def _passes(serving: Serving, step: Pinning) -> Passes:
    return Passes(make_mocked_request("POST", PATH), serving, _host(serving), PATH, steps=(Before((PATH,), step.run),))


async def test_a_pass_to_another_server_runs_the_steps_again_there_unpinned(serving: Serving) -> None:
    step = Pinning()
    passes = _passes(serving, step)
    first = Outgoing("POST", PATH, b'{"prompt": "x"}', {"prompt": "x"}, Asked(PATH))
    assert await passes.stepped(first) is None
    old = serving.current
    serving.install(serving.new_generation(old.config, old.launch))  # a crash's restart: another server serves
    got = await passes.send(first.body, Shape.WHOLE, lambda payload, status: False, None, None)
    assert got.outcome is Outcome.CUT  # nothing listens: what matters is what the steps saw before the pass
    assert [generation for generation, _ in step.runs] == [old, serving.current]
    assert step.runs[1][1] == {"prompt": "x"}  # its own pin on the earlier server is not the client's: dropped
    assert step.told == [None]  # the earlier run is over (cut), its slot let go; the new one waits for the end
    passes.done(200)
    assert step.told == [None, 200]


async def test_a_pass_to_the_server_the_steps_ran_on_runs_them_once(serving: Serving) -> None:
    step = Pinning()
    passes = _passes(serving, step)
    first = Outgoing("POST", PATH, b'{"prompt": "x"}', {"prompt": "x"}, Asked(PATH))
    await passes.stepped(first)
    for _ in range(2):  # sent again to the same server (a refusal, a growth that did not reload): no new run
        await passes.send(first.body, Shape.WHOLE, lambda payload, status: False, None, None)
    assert len(step.runs) == 1 and step.told == []


async def test_a_slot_the_client_asked_for_stays_asked_for(serving: Serving) -> None:
    step = Pinning()
    passes = _passes(serving, step)
    passes.asked = Asked(PATH, "alice#3f9a", session="s-1")
    first = Outgoing("POST", PATH, b'{"prompt": "x", "id_slot": 1}', {"prompt": "x", "id_slot": 1}, passes.asked)
    await passes.stepped(first)
    serving.install(serving.new_generation(serving.current.config, serving.current.launch))
    await passes.send(first.body, Shape.WHOLE, lambda payload, status: False, None, None)
    assert step.runs[1][1] == {"prompt": "x", "id_slot": 1}
    assert step.asked == [passes.asked, passes.asked]  # the run on the new server is told who asks as the first was
