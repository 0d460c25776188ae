"""Who may ask what of the wrapper's HTTP face: the application's keys (what serves, its life, the supervisor),
llama-server's own API keys for what it would answer, the admin token for the wrapper's own POSTs, and a JSON
body read with a message that says where it is wrong."""

from __future__ import annotations

import json
from typing import Any

import structlog
from aiohttp import web
from multidict import CIMultiDict

from wrapper.answers.proxy import json_error
from wrapper.configuration import consumers
from wrapper.configuration.auth import allowed, presented, read_token
from wrapper.configuration.consumers import CONSUMERS
from wrapper.life.server_life import ServerLife
from wrapper.life.supervisor import Supervisor
from wrapper.serving import Serving

log = structlog.get_logger()

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
SERVING: web.AppKey[Serving] = web.AppKey("serving", Serving)
LIFE: web.AppKey[ServerLife] = web.AppKey("life", ServerLife)


def unauthorized(request: web.Request) -> web.Response | None:
    """llama-server's own 401 when it has API keys and the request brings none of them (in the shape of the API the
    request speaks)."""
    keys = request.app[SERVING].current.launch.keys
    if keys and not allowed(keys, presented(request.headers)):
        return json_error(401, "Invalid API Key", "authentication_error", path=request.path)
    return None


def not_admin(request: web.Request, because: str = "") -> web.Response | None:
    """POST /wrapper/* needs the admin token; without one configured, those endpoints are off. `because`: why this
    endpoint needs it (said first)."""
    admin = request.app[SERVING].current.launch.admin
    was_off = admin.off
    token, why = admin.read()  # read at each call: a token file made after the start turns them on
    said = f"{because}; " if because else ""
    if token is None:
        return json_error(403, f"{said}admin endpoints are off: {why}", "permission_error")
    if was_off is not None:
        log.info("admin.on", why="the admin token can be read now")
    if not allowed((token,), presented(request.headers)):
        return json_error(401, f"{said}a wrong or missing admin token (Authorization: Bearer <token>)"
                          + admin.unused_env, "authentication_error")
    return None


def not_operator(request: web.Request, what: str,
                 why: str = "it tells what each consumer keeps and does") -> web.Response | None:
    """What tells one consumer's activity (`what`: the status, /metrics, llama-server's /slots) is the admin's under
    consumers.isolate; else any of llama-server's keys reads it, as before. The read-only token
    (`admin.read_token_file`: Prometheus', a router's) reads it either way, and may do nothing else."""
    reader = read_token(request.app[SERVING].current.launch.read_token_file)
    if reader is not None and allowed((reader,), presented(request.headers)):
        return None
    if consumers.isolating(CONSUMERS.of(request.app[SERVING].current.config)):
        return not_admin(request, f"under consumers.isolate {what} is the admin's ({why}); a router or Prometheus "
                                  "reads it with the read-only token (admin.read_token_file)")
    return unauthorized(request)


def as_server_reads(request: web.Request) -> web.Request:
    """`request`, asked with the read-only token, as llama-server takes it: with one of its own keys in place of the
    token (which it does not know and would refuse); any other request as it came."""
    launch = request.app[SERVING].current.launch
    reader = read_token(launch.read_token_file)
    if not launch.keys or reader is None or not allowed((reader,), presented(request.headers)):
        return request
    headers = CIMultiDict(request.headers)
    headers.popall("X-Api-Key", None)
    headers["Authorization"] = f"Bearer {launch.keys[0]}"
    return request.clone(headers=headers)


class NotJson(ValueError):
    """A request body that does not parse: the message says where (the parser's line and column)."""


async def json_body(request: web.Request) -> Any:
    """The body parsed as JSON; None for an empty one; _NotJson for one that is not JSON at all."""
    raw = await request.read()
    if not raw.strip():
        return None
    try:
        return json.loads(raw.decode(request.charset or "utf-8"))
    except json.JSONDecodeError as exc:
        raise NotJson(f"the body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise NotJson(f"the body is not valid JSON: not {exc.encoding} text (byte {exc.start})") from exc
    except LookupError as exc:  # a charset Python does not know
        raise NotJson(f"the body is not valid JSON: an unknown charset {request.charset!r}") from exc


async def object_body(request: web.Request, what: str) -> dict[str, Any] | web.Response:
    """The body as a JSON object, or the 400 that says it is not one (`what`: what the object is of)."""
    try:
        body = await json_body(request)
    except NotJson as exc:
        return json_error(400, str(exc), "invalid_request_error")
    if not isinstance(body, dict):
        return json_error(400, f"the body must be a JSON object{what}", "invalid_request_error")
    return body
