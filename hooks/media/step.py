"""Before a request that carries media: with the projector loaded, on; on demand, a reload that loads it
first (the request is held meanwhile, as any request during a reload); with no projector at all, the
wrapper's 400 that says so instead of llama-server's 500."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import structlog

from hooks.asks import Projector, asking
from hooks.media.detect import media_in
from hooks.media.report import learn
from hooks.media.settings import on_demand
from hooks.media.state import configured, loaded, state
from wrapper.metrics import METRICS
from wrapper.reload_ask import Reloaded, Unchanged, ask_reload
from wrapper.server.generation import Generation, Host
from wrapper.server.llama import LlamaError
from wrapper.steps import Outgoing, Reply, error_body

log = structlog.get_logger()

RETRY_AFTER_S = "5"
DEFAULT_MARKER = "<__media__>"  # mtmd's documented default, which the pinned server no longer takes
_SEES = {"image": "vision", "video": "vision", "audio": "audio"}  # the /props modality each kind needs


async def before(host: Host, out: Outgoing) -> Outgoing | Reply:
    kind = media_in(out.payload)
    if kind is None:
        return out
    generation = host.current
    kept = state(generation)
    kept.seen()
    out.after.append(lambda _status: kept.left())
    if loaded(generation):
        await _current_marker(host, out)
        return out
    config = generation.config
    if on_demand(config) and configured(config):
        loading = await _load(host, kind, out)
        if isinstance(loading, Outgoing):
            await _current_marker(host, loading)
        return loading
    if await _sees(generation, kind):
        return out  # a projector the wrapper did not see in the argv (-hf downloads one): the server answers
    kept.refused += 1
    METRICS.projector_changes.labels(change="refused").inc()
    log.info("media.refused", kind=kind, path=out.path)
    return Reply(400, error_body(400, f"this model has no projector: the request carries {kind}, and llama-server "
                                 "runs without one (give --mmproj FILE in its argv, with media.projector: "
                                 "on_demand to load it only when media arrives)", "invalid_request_error"))


async def _load(host: Host, kind: str, out: Outgoing) -> Outgoing | Reply:
    kept, began = state(host.current), time.monotonic()
    log.info("media.projector_loading", kind=kind, path=out.path)
    asked = await ask_reload(host, f"media: a request with {kind} arrived", asking(Projector(wanted=True)))
    seconds = round(time.monotonic() - began, 3)
    if isinstance(asked, Reloaded | Unchanged) and loaded(host.current):
        if isinstance(asked, Reloaded):
            with contextlib.suppress(LlamaError):
                learn(host.current, await host.current.props())
            kept.loads += 1
            METRICS.projector_changes.labels(change="loaded").inc()
            log.info("media.projector_loaded", **kept.decisions.made(change="loaded", kind=kind, wait_s=seconds,
                                                              downtime_ms=asked.answer.get("downtime_ms")))
        return out
    reason = "the new llama-server runs without it" if isinstance(asked, Reloaded | Unchanged) else asked.reason
    kept.wanted = False
    log.warning("media.projector_failed", **kept.decisions.made(change="failed", kind=kind, wait_s=seconds,
                                                         reason=str(reason)))
    return Reply(503, error_body(503, f"the projector could not be loaded for this request's {kind}: {reason}",
                                 "unavailable_error"), {"Retry-After": RETRY_AFTER_S})


async def _server(generation: Generation) -> dict[str, Any]:
    """What the running server process says of media (its /props, asked once per process: each start draws
    another marker): `modalities` and its `media_marker`; empty when it cannot be asked (then the server
    answers for itself)."""
    try:
        props = await generation.props()
    except LlamaError:
        return {}
    modalities = props.get("modalities")
    return {"modalities": {str(k): bool(v) for k, v in modalities.items()} if isinstance(modalities, dict) else {},
            "marker": props.get("media_marker") if isinstance(props.get("media_marker"), str) else None}


async def _sees(generation: Generation, kind: str) -> bool:
    """Whether the running server says it takes this kind of media; True when it cannot be asked."""
    known = await _server(generation)
    return "modalities" not in known or bool(known["modalities"].get(_SEES[kind]))


async def _current_marker(host: Host, out: Outgoing) -> None:
    """A /completion prompt written with the media marker of an earlier start (the client read /props before
    a reload) is given the running server's: each llama-server start draws another."""
    prompt = out.payload.get("prompt") if out.payload is not None else None
    prompts = prompt if isinstance(prompt, list) else [prompt]
    kept = state(host.current)
    marker = (await _server(host.current)).get("marker")
    old = [m for m in {*kept.markers, DEFAULT_MARKER} if m != marker]
    if not marker or not old:
        return
    changed = False
    for each in prompts:
        text = each.get("prompt_string") if isinstance(each, dict) else None
        if isinstance(each, dict) and isinstance(text, str) and each.get("multimodal_data"):
            for stale in old:
                if stale in text:
                    text, changed = text.replace(stale, marker), True
            each["prompt_string"] = text
    if changed and out.payload is not None:
        out.body = json.dumps(out.payload).encode()
        log.info("media.marker_replaced", path=out.path, markers=len(old))
