"""The reverse proxy to llama-server: every method and path, bodies streamed back chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

log = structlog.get_logger()

# RFC 9110 §7.6.1 hop-by-hop headers, plus those aiohttp must compute itself for the new connection.
HOP_BY_HOP = frozenset(
    h.lower() for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection", "TE",
        "Trailer", "Trailers", "Transfer-Encoding", "Upgrade", "Host", "Content-Length",
    )
)
TAP_LIMIT = 64 * 1024  # how much of a response's end an observer gets to see

Observer = Callable[[str, int, bytes], None]
"""Called with (path, status, the last bytes of the body) once a response has been passed on whole."""


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error in llama-server's own shape, so clients parse it the same way."""
    body = {"error": {"code": status, "message": message, "type": kind}}
    return web.json_response(body, status=status, headers=headers)


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


async def forward(
    request: web.Request, upstream: str, session: aiohttp.ClientSession, observer: Observer | None = None
) -> web.StreamResponse:
    """Pass `request` to `upstream` and its answer back, streaming the body without buffering it."""
    body = await request.read() if request.body_exists else None
    url = upstream + request.rel_url.raw_path_qs
    response: web.StreamResponse | None = None
    try:
        async with session.request(
            request.method, url, headers=_forwardable(request.headers), data=body,
            allow_redirects=False,
        ) as reply:
            response = web.StreamResponse(status=reply.status, reason=reply.reason,
                                          headers=_forwardable(reply.headers))
            if reply.content_length is not None and "Content-Encoding" not in reply.headers:
                response.content_length = reply.content_length
            if reply.content_type == "text/event-stream":
                response.headers["X-Accel-Buffering"] = "no"
            await response.prepare(request)
            tail = b""
            async for chunk in reply.content.iter_any():
                await response.write(chunk)
                if observer is not None:
                    tail = (tail + chunk)[-TAP_LIMIT:]
            await response.write_eof()
    except aiohttp.ClientError as exc:
        log.warning("proxy.upstream_error", method=request.method, path=request.path, error=str(exc),
                    mid_response=response is not None)
        if response is not None and response.prepared:
            # Headers are gone already: drop the connection so the client sees a truncated answer, not a whole one.
            raise ConnectionResetError(f"llama-server broke off the response: {exc}") from exc
        return json_error(502, f"llama-server could not be reached: {exc}", "bad_gateway")
    if observer is not None:
        observer(request.path, reply.status, tail)
    return response
