"""Built-in `server.reload`: reconfigure a wrapper's llama-server from a hook (POST /wrapper/reload).

Options are the fields of the endpoint (n_ctx, cache_type_k, cache_type_v, swa_full, kv_unified, spec, mmproj,
args), plus `url` (another wrapper; default this one) and `token_file` (its admin token; default
LLAMA_WRAPPER_ADMIN_TOKEN, or this wrapper's own token when the url is this wrapper's). E.g. a model of a
llama-swap group shrinking the other one before it starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from wrapper.actions import ActionError
from wrapper.configuration.auth import admin_token
from wrapper.configuration.reload_plan import FIELDS
from wrapper.server.generation import Generation

OPTIONS = ("url", "token_file", *FIELDS)


def check(options: Mapping[str, Any]) -> list[str]:
    unknown = sorted(set(options) - set(OPTIONS))
    problems = [f"unknown option(s) {', '.join(unknown)} (known: {', '.join(OPTIONS)})"] if unknown else []
    if not set(options) & set(FIELDS):
        problems.append(f"says nothing to change: give one of {', '.join(FIELDS)} under `with:`")
    return problems


def _token(generation: Generation, url: str, token_file: Any) -> str | None:
    """token_file, else LLAMA_WRAPPER_ADMIN_TOKEN, else this wrapper's own token when the url is its own."""
    try:
        token = admin_token(Path(str(token_file)).expanduser() if token_file else None, os.environ)
    except ValueError as exc:
        raise ActionError(str(exc)) from exc
    if token is None and url == generation.launch.listen.url.rstrip("/"):
        token = generation.launch.admin.read()[0]
    return token


async def run(generation: Generation, options: Mapping[str, Any]) -> str:
    url = str(options.get("url") or generation.launch.listen.url).rstrip("/")
    token = _token(generation, url, options.get("token_file"))
    body = {key: value for key, value in options.items() if key in FIELDS}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with aiohttp.ClientSession() as session, session.post(
            f"{url}/wrapper/reload", json=body, headers=headers
        ) as reply:
            answer = await reply.json(content_type=None)
    except (aiohttp.ClientError, ValueError) as exc:
        raise ActionError(f"POST {url}/wrapper/reload: {exc}") from exc
    if not isinstance(answer, dict):
        raise ActionError(f"POST {url}/wrapper/reload: HTTP {reply.status}, not a JSON object")
    if "error" in answer:
        raise ActionError(f"{url} refused the reload (HTTP {reply.status}): {answer['error'].get('message')}")
    if not answer.get("success"):
        raise ActionError(f"{url}: {answer.get('message')}")
    return (f"{url}: n_ctx {answer.get('n_ctx')}, downtime {answer.get('downtime_ms')} ms "
            f"({'overlapped' if answer.get('overlap') else 'sequential'})")
