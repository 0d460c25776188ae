"""The reverse proxy to llama-server: every method and path, bodies streamed both ways without buffering."""

from __future__ import annotations

import contextlib
import json
import posixpath
import re
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import quote, unquote

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from wrapper.answers import apis
from wrapper.answers.events import Events
from wrapper.configuration.auth import as_llama_server_reads
from wrapper.steps import Observer, error_body

log = structlog.get_logger()

# RFC 9110 §7.6.1 hop-by-hop headers, plus those aiohttp must compute itself for the new connection, and the
# wrapper's own (wrapper/queue/priority.py: llama-server does not know it).
HOP_BY_HOP = frozenset(
    h.lower() for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "TE",
        "Trailer", "Trailers", "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "X-Priority",
    )
)
TAP_LIMIT = 64 * 1024  # how much of a response's end an observer gets to see
WHOLE_LIMIT = 256 * 1024  # an answer of known length up to this is read whole and sent in one write
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_PATH_SAFE = "/:@!$&'()*+,;=-._~"  # RFC 3986 pchar without '%': kept as they are when re-encoding

STARTED = "wrapper.response"  # request key: the response once its headers went to the client

class BadPath(ValueError):
    """A request path no server should act on (control characters after decoding)."""


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None,
               path: str | None = None) -> web.Response:
    """An error answered whole: llama-server's shape, or the shape of the API a request on `path` speaks (Anthropic's
    on /v1/messages, so that its client says why)."""
    body = apis.of(path).error_body(status, message, kind) if path is not None else error_body(status, message, kind)
    return web.json_response(body, status=status, headers=headers)


def canonical_path(raw_path: str) -> str:
    """The path llama-server will act on: percent-decoded once, `//` folded, dot segments removed.

    The wrapper checks this path and forwards this path, so no spelling can make the two disagree.
    """
    decoded = unquote(raw_path, errors="strict")
    if _CONTROL.search(decoded):
        raise BadPath("control characters in the request path")
    trailing = decoded.endswith("/") and decoded != "/"
    path = posixpath.normpath("/" + decoded.lstrip("/"))
    path = "/" + path.lstrip("/")  # normpath keeps a leading '//'
    if trailing and path != "/":
        path += "/"
    return quote(path, safe=_PATH_SAFE)


def json_object(raw: bytes) -> dict[str, Any] | None:
    """`raw` as a JSON object, or None when it is not one."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # nested deeper than Python's parser goes: passed on as it is
        return None
    return value if isinstance(value, dict) else None


async def _once(raw: bytes) -> AsyncIterator[bytes]:
    if raw:
        yield raw


async def broken_off(request: web.BaseRequest, response: web.StreamResponse, why: str) -> web.StreamResponse:
    """Headers are gone already: an event stream is told `why` in its API's error event (OpenAI's `data:` line with an
    `error`, Anthropic's `event: error`, the Responses API's `error` event: each one's client raises it; it has no
    final event) and ends there, as llama-server ends a stream after an error, so that a client reading the whole
    body gets the error too; any other answer is cut (the connection closed) so that it is seen truncated."""
    if response.content_type == "text/event-stream":
        event = apis.of(request.path).error_event(502, why, "server_error")
        with contextlib.suppress(ConnectionError, RuntimeError):  # a client gone already
            await response.write(event)
            await response.write_eof()
            return response
    if request.transport is not None:
        request.transport.close()
    return response


def _forwardable(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The end-to-end headers: hop-by-hop ones and those the Connection header names are dropped."""
    out: CIMultiDict[str] = CIMultiDict()
    items = list(headers.items())
    connection_tokens: set[str] = set()
    for key, value in items:
        if key.lower() == "connection":
            connection_tokens.update(token.strip().lower() for token in value.split(","))
    for key, value in items:
        if key.lower() not in HOP_BY_HOP and key.lower() not in connection_tokens:
            out.add(key, value)
    return out


class Outcome(Enum):
    """What one pass to llama-server came to."""

    ANSWERED = "answered"  # passed on to the client as it came (or a refusal for it): `response` is its answer
    CAUGHT = "caught"  # a whole JSON answer kept from the client (`catching` said so): `status`, `payload`, `headers`
    HELD = "held"  # an event stream passed on but for its last events (`events`): `response` still open
    GATHERED = "gathered"  # an event stream read to its end into `events`, nothing of it passed on
    CUT = "cut"  # llama-server went away under it (`error`), before its answer reached the client or in the middle
    PAUSED = "paused"  # its seat was asked to pause: the exchange stopped (wrapper/queue/seats.py)


@dataclass(frozen=True)
class Pass:
    """One pass to llama-server: its outcome, and the client's response once any of the answer reached it."""

    outcome: Outcome
    request: web.BaseRequest
    response: web.StreamResponse | None = None
    status: int = 0
    payload: dict[str, Any] = field(default_factory=dict)
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)  # llama-server's, hop-by-hop ones dropped
    events: Events | None = None
    error: str = ""
    handed_over: bool = False  # a reload cut it to go on on the next server (wrapper/queue/gate.py)

    @property
    def answered(self) -> web.StreamResponse:
        """The client's answer of an ANSWERED pass."""
        assert self.response is not None
        return self.response

    async def told(self, why: str | None = None) -> web.StreamResponse:
        """What the client of a CUT pass is told when it does not go on (`why`; default: that llama-server could not
        be reached, and the error): a 502, or once the answer had begun an error event and a closed connection."""
        said = why or f"llama-server could not be reached: {self.error}"
        if self.response is not None and self.response.prepared:
            return await broken_off(self.request, self.response, said)
        return json_error(502, said, "bad_gateway", path=self.request.path)


def answered(request: web.BaseRequest, response: web.StreamResponse) -> Pass:
    return Pass(Outcome.ANSWERED, request, response)


CAUGHT_LIMIT = 8 << 20  # an answer larger than this is passed on, never caught


@dataclass(frozen=True)
class Upstream:
    """Where a request goes: llama-server's URL, the one client session, what watches its answers, and what is
    told each time the exchange sends or hears something (the watchdog's stall)."""

    url: str
    session: aiohttp.ClientSession
    observer: Observer | None = None
    heard: Callable[[], None] | None = None


Catching = Callable[[dict[str, Any], int], bool]  # (a whole JSON answer, its status): keep it from the client


async def forward(request: web.Request, to: Upstream, path: str | None = None, body: bytes | None = None,
                  events: Events | None = None, going_on: web.StreamResponse | None = None) -> Pass:
    """Stream through: pass `request` to llama-server (at `path`, default its own) and the answer back, both bodies
    streamed. `body`: the request body, read already (else streamed from the client). `events`: an event stream
    is passed through it, HELD when it held something back; `going_on`: the client's response, still open, that
    this answer continues. ANSWERED, or CUT when llama-server went away under it."""
    return await catch(request, to, _nothing_caught, path, body, events, going_on)


def _nothing_caught(payload: dict[str, Any], status: int) -> bool:
    return False


async def catch(request: web.Request, to: Upstream, catching: Catching, path: str | None = None,
                body: bytes | None = None, events: Events | None = None,
                going_on: web.StreamResponse | None = None) -> Pass:
    """As `forward`, but a whole JSON answer (not streamed, at most CAUGHT_LIMIT) that `catching` accepts is CAUGHT
    instead of being sent (the caller may send the request again, or go on from it); any other answer is streamed
    through."""
    path = path if path is not None else request.rel_url.raw_path
    try:
        async with _sent(request, to, path, body) as reply:
            read: bytes | None = None  # an answer read whole to be looked at
            if _catchable(reply) and catching is not _nothing_caught:
                read = await reply.read()
                payload = json_object(read)
                if payload is not None and catching(payload, reply.status):
                    return Pass(Outcome.CAUGHT, request, None, reply.status, payload, _forwardable(reply.headers))
            return await _through(request, reply, to, path, read, events, going_on)
    except aiohttp.ClientError as exc:
        return _unreachable(request, path, exc, going_on)


async def collect(request: web.Request, to: Upstream, catching: Catching, path: str, body: bytes,
                  events: Events) -> Pass:
    """As `catch`, but an event stream is read into `events`, GATHERED, never passed on (a request that asked for
    one JSON answer, sent as a stream so that it can be paused: wrapper/answers/gathered.py)."""
    try:
        async with _sent(request, to, path, body) as reply:
            if reply.content_type != "text/event-stream":
                read = await reply.read() if _catchable(reply) else None
                payload = json_object(read) if read is not None else None
                if payload is not None and catching(payload, reply.status):
                    return Pass(Outcome.CAUGHT, request, None, reply.status, payload, _forwardable(reply.headers))
                return await _through(request, reply, to, path, read, None, None)
            if reply.connection is not None and reply.connection.protocol is not None:
                reply.connection.protocol.force_close()  # as in _through: llama-server closes it after a stream
            tail = bytearray()
            async for chunk in reply.content.iter_any():
                if to.heard is not None:
                    to.heard()
                events.feed(chunk)
                tail += chunk
                if len(tail) > 2 * TAP_LIMIT:
                    del tail[:-TAP_LIMIT]
            if to.observer is not None:
                to.observer(path, reply.status, bytes(tail[-TAP_LIMIT:]))
            return Pass(Outcome.GATHERED, request, None, reply.status, events=events)
    except aiohttp.ClientError as exc:
        return _unreachable(request, path, exc, None)


def _unreachable(request: web.Request, path: str, exc: aiohttp.ClientError,
                 going_on: web.StreamResponse | None) -> Pass:
    """llama-server went away: before the answer began, or in the middle of it."""
    response = going_on if going_on is not None else request.get(STARTED)
    log.warning("proxy.upstream_error", method=request.method, path=path, error=_plainly(exc), detail=str(exc),
                mid_response=response is not None)
    return Pass(Outcome.CUT, request, response if response is not None and response.prepared else None,
                error=str(exc))


def _plainly(exc: aiohttp.ClientError) -> str:
    """What went wrong, in words (aiohttp says "TransferEncodingError: 400, message='Not enough data…'" when a
    stream's connection closes in the middle: no HTTP status 400 was ever sent)."""
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "llama-server's connection closed in the middle of its answer (it stopped or crashed)"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "llama-server closed the connection before it answered (it stopped or crashed)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "llama-server could not be reached"
    return str(exc)


def _catchable(reply: aiohttp.ClientResponse) -> bool:
    return reply.content_length is not None and reply.content_length <= CAUGHT_LIMIT and \
        reply.content_type == "application/json"


@contextlib.asynccontextmanager
async def _sent(request: web.Request, to: Upstream, path: str,
                body: bytes | None) -> AsyncIterator[aiohttp.ClientResponse]:
    """The request sent to llama-server as checked (never normalised again), with its end-to-end headers."""
    query = request.rel_url.raw_query_string
    url = URL(to.url + path + (f"?{query}" if query else ""), encoded=True)
    if to.heard is not None:
        to.heard()
    headers = _forwardable(request.headers)
    if (authorization := as_llama_server_reads(request.headers)) is not None:
        headers["Authorization"] = authorization  # the key as the wrapper read it (wrapper/configuration/auth.py)
    if body is not None:
        headers["Content-Length"] = str(len(body))
    elif request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)  # else aiohttp sends the body chunked
    async with to.session.request(
        request.method, url, headers=headers,
        data=body if body is not None else request.content if request.body_exists else None,
        allow_redirects=False,
    ) as reply:
        yield reply


async def _through(request: web.Request, reply: aiohttp.ClientResponse, to: Upstream, path: str,
                   read: bytes | None, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
    """Pass the answer on as it comes (`read`: what was read of it already), through `events` when it is an event
    stream: HELD when `events` kept its end back, else ANSWERED."""
    upstream_connection = reply.connection.protocol if reply.connection is not None else None
    if reply.content_length is None and upstream_connection is not None:
        # llama-server closes the connection after a streamed (chunked) answer although it announced
        # keep-alive; pooled again, the next request sent on it failed with "Server disconnected" (1
        # streamed request in 8). Mark it now: aiohttp pools it the moment the body ends.
        upstream_connection.force_close()
    if reply.content_type != "text/event-stream":
        events = None  # an error answer: passed on whole, as it is
        if going_on is None and _small(request, reply):
            return answered(request, await _whole(request, reply, to, path, read))
    response = going_on if going_on is not None else await _started(request, reply)
    tail = bytearray()
    observer, heard = to.observer, to.heard
    chunks = _once(read) if read is not None else reply.content.iter_any()
    async for chunk in chunks:
        if heard is not None:
            heard()
        passed = events.feed(chunk) if events is not None else chunk
        if passed:
            await response.write(passed)
        if observer is not None:
            tail += chunk
            if len(tail) > 2 * TAP_LIMIT:  # trimmed now and then: no copy of the window per chunk
                del tail[:-TAP_LIMIT]
    if observer is not None:
        observer(path, reply.status, bytes(tail[-TAP_LIMIT:]))
    if events is not None and events.held:
        return Pass(Outcome.HELD, request, response, reply.status, events=events)
    await response.write_eof()
    return answered(request, response)


def _small(request: web.Request, reply: aiohttp.ClientResponse) -> bool:
    return request.method != "HEAD" and reply.content_length is not None and 0 < reply.content_length <= WHOLE_LIMIT


async def _whole(request: web.Request, reply: aiohttp.ClientResponse, to: Upstream, path: str,
                 read: bytes | None) -> web.Response:
    """A small answer of known length, read whole and passed on in one write (its headers with it)."""
    body = read if read is not None else await reply.read()
    if to.heard is not None:
        to.heard()
    if to.observer is not None:
        to.observer(path, reply.status, body[-TAP_LIMIT:])
    return web.Response(body=body, status=reply.status, reason=reply.reason, headers=_forwardable(reply.headers))


async def _started(request: web.Request, reply: aiohttp.ClientResponse) -> web.StreamResponse:
    """The client's response, its headers sent: llama-server's status and end-to-end headers."""
    response = web.StreamResponse(status=reply.status, reason=reply.reason, headers=_forwardable(reply.headers))
    if reply.content_length is not None and "Content-Encoding" not in reply.headers:
        response.content_length = reply.content_length
    if reply.content_type == "text/event-stream":
        response.headers["X-Accel-Buffering"] = "no"
    await response.prepare(request)
    request[STARTED] = response
    return response
