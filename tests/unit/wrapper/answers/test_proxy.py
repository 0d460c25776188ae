"""The proxy with a tiny real child: methods, paths, headers, streaming, slot-action refusal, upstream errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import Wrapper, child_argv, free_port, http, running
from wrapper.answers.proxy import BadPath, Outcome, Upstream, canonical_path, forward


@pytest.fixture
def wrapper(tmp_path: Path) -> Iterator[Wrapper]:
    with running(tmp_path, child_argv(), timeout=30) as ready:
        yield ready


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE", "PATCH"])
def test_every_method_path_query_and_body_passes(wrapper: Wrapper, method: str) -> None:
    body = {"x": "ü" * 3} if method != "GET" else None
    status, _, raw = http(method, f"{wrapper.url}/echo?a=1&b=%20", body, headers={"X-Custom": "v"})
    echoed = json.loads(raw)
    assert status == 200 and echoed["method"] == method and echoed["query"] == "a=1&b=%20"
    assert echoed["headers"]["X-Custom"] == "v"
    if body:
        assert json.loads(echoed["body"]) == body


def test_hop_by_hop_headers_are_not_forwarded(wrapper: Wrapper) -> None:
    connection = HTTPConnection("127.0.0.1", wrapper.port, timeout=10)
    connection.request("GET", "/echo", headers={"Connection": "keep-alive, X-Private", "X-Private": "secret",
                                                "Keep-Alive": "5", "Proxy-Authorization": "x", "X-Kept": "1"})
    headers = {k.lower() for k in json.loads(connection.getresponse().read())["headers"]}
    connection.close()
    assert "x-kept" in headers
    assert not headers & {"x-private", "keep-alive", "proxy-authorization"}


def test_the_priority_a_request_says_is_not_sent_on(wrapper: Wrapper) -> None:
    """llama-server does not know X-Priority nor service_tier: the wrapper reads them, llama-server never sees them."""
    body = {"messages": [{"role": "user", "content": "hi"}], "service_tier": "flex", "max_tokens": 4}
    status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", body, headers={"X-Priority": "background"})
    seen = json.loads(raw)
    assert status == 200 and seen["path"] == "/v1/chat/completions"
    assert "x-priority" not in {k.lower() for k in seen["headers"]}
    assert json.loads(seen["body"]) == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_event_stream_passes_chunk_by_chunk(wrapper: Wrapper) -> None:
    """The child holds the rest of its stream until we have read the first event through the proxy."""
    connection = HTTPConnection("127.0.0.1", wrapper.port, timeout=10)
    connection.request("GET", "/stream?n=3&gate=1")
    reply = connection.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type") == "text/event-stream"
    assert reply.getheader("X-Accel-Buffering") == "no"
    first = reply.readline()
    assert first == b'data: {"index": 0}\n'  # arrived while the child was still waiting to go on
    child = wrapper.status()["server"]["url"]
    assert http("GET", f"{child}/release")[0] == 200
    rest = reply.read()
    assert rest.count(b"data: ") == 2
    connection.close()


def test_client_slot_actions_are_refused(wrapper: Wrapper) -> None:
    status, _, raw = http("POST", f"{wrapper.url}/slots/0?action=save", {"filename": "x"})
    assert status == 403 and b"proxy.allow_slot_actions" in raw
    assert http("GET", f"{wrapper.url}/slots")[0] == 200  # reading is fine


def test_health_is_the_wrappers_own(tmp_path: Path) -> None:
    """The wrapper answers /health itself (the child never sees it once ready); other paths reach the child."""
    record = tmp_path / "requests.log"
    with running(tmp_path, child_argv("--record", str(record)), timeout=30) as wrapper:
        seen_at_ready = record.read_text().splitlines()
        for _ in range(3):
            status, _, raw = http("GET", f"{wrapper.url}/health")
            assert status == 200 and json.loads(raw) == {"status": "ok"}
        assert http("GET", f"{wrapper.url}/v1/models")[0] == 200
        assert record.read_text().splitlines()[len(seen_at_ready):] == ["GET /v1/models"]


async def test_unreachable_upstream_is_a_502_json_error() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        async def handler(request: web.Request) -> web.StreamResponse:
            answer = await forward(request, Upstream(dead, session))
            assert answer.outcome is Outcome.CUT and answer.response is None  # nothing of an answer had begun
            return await answer.told()

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with session.get(f"http://127.0.0.1:{port}/v1/models") as reply:
                body = await reply.json()
            assert reply.status == 502 and body["error"]["type"] == "bad_gateway"
        finally:
            await runner.cleanup()


@pytest.mark.parametrize(("raw", "canonical"), [
    ("/slots/0", "/slots/0"), ("/./slots/0", "/slots/0"), ("/x/../slots/0", "/slots/0"), ("//slots/0", "/slots/0"),
    ("/%73lots/0", "/slots/0"), ("/slots%2F0", "/slots/0"), ("/%2e%2e/slots/0", "/slots/0"), ("/../../slots", "/slots"),
    ("/v1/chat/completions", "/v1/chat/completions"), ("/a%20b/", "/a%20b/"), ("/", "/"), ("/100%25", "/100%25"),
])
def test_the_path_checked_is_the_path_forwarded(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical


@pytest.mark.parametrize("raw", ["/a%00b", "/slots/0%0a", "/%7f"])
def test_control_characters_in_a_path_are_refused(raw: str) -> None:
    with pytest.raises(BadPath):
        canonical_path(raw)


def test_slot_actions_in_other_spellings_are_refused(wrapper: Wrapper) -> None:
    for target in ("/%73lots/0?action=erase", "/x/../slots/0?action=save", "//slots/1?action=restore"):
        connection = HTTPConnection("127.0.0.1", wrapper.port, timeout=10)
        connection.request("POST", target, body=b"{}")
        assert connection.getresponse().status == 403, target
        connection.close()
    connection = HTTPConnection("127.0.0.1", wrapper.port, timeout=10)
    connection.request("GET", "/x/../echo")
    assert json.loads(connection.getresponse().read())["path"] == "/echo"  # what the child saw: the checked path
    connection.close()
