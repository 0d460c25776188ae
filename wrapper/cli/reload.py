"""`llama-wrapper reload`: ask a running wrapper to reconfigure its llama-server (POST /wrapper/reload)."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click
import yaml

from wrapper.configuration.auth import ADMIN_TOKEN_ENV, AdminToken, default_token_file, token_path
from wrapper.configuration.exits import EXIT_FAILED
from wrapper.configuration.reload_plan import CACHE_TYPES


def _assignment(text: str) -> tuple[str, Any]:
    flag, eq, value = text.partition("=")
    if not flag.startswith("-"):
        raise click.BadParameter(f"{text!r}: write FLAG=VALUE (or FLAG alone for a switch), e.g. --set -ngl=99")
    return flag, value if eq else True


def _token_file_of(config_path: Path | None) -> Path | None:
    """The config's admin.token_file, read without the rest of the config (reload loads no built-ins)."""
    if config_path is None:
        return None
    try:
        root = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise click.UsageError(f"--config {config_path}: cannot read it: {exc}") from exc
    admin = root.get("admin") if isinstance(root, dict) else None
    named = admin.get("token_file") if isinstance(admin, dict) else None
    return token_path(named) if isinstance(named, str) and named else None


def _where_looked(token_file: Path | None, config_path: Path | None) -> str:
    env = os.environ
    config_file = _token_file_of(config_path)
    places = [
        f"--token-file {token_file}" if token_file else "--token-file (not given)",
        (f"admin.token_file of {config_path}: {config_file}" if config_file else
         f"{config_path} (no admin.token_file)" if config_path else "--config / LLAMA_WRAPPER_CONFIG (not given)"),
        f"{ADMIN_TOKEN_ENV} (set)" if env.get(ADMIN_TOKEN_ENV) else f"{ADMIN_TOKEN_ENV} (not set)",
        f"{default_token_file(env)} ({'found' if default_token_file(env).exists() else 'missing'})",
    ]
    return "looked in " + "; ".join(places) + ": the first one found is sent, and it must be the wrapper's"


@click.command(epilog="""
\b
Examples:
  llama-wrapper reload --ctx 32768
  llama-wrapper reload --cache-type q8_0 --ctx 65536
  llama-wrapper reload --set --swa-full --remove --mmproj --url http://127.0.0.1:8081
The token is the wrapper's admin token, found as the wrapper finds it: --token-file, else the admin.token_file
of --config (or $LLAMA_WRAPPER_CONFIG), else $LLAMA_WRAPPER_ADMIN_TOKEN, else ~/.config/llama-wrapper/admin-token.
""")
@click.option("--url", default="http://127.0.0.1:8080", envvar="LLAMA_WRAPPER_URL", show_envvar=True,
              show_default=True, help="The wrapper's public address.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Read the admin token from this file [default: the config's admin.token_file, else "
                   f"${ADMIN_TOKEN_ENV}, else ~/.config/llama-wrapper/admin-token].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              envvar="LLAMA_WRAPPER_CONFIG", show_envvar=True,
              help="The wrapper's config: its admin.token_file holds the token.")
@click.option("--ctx", type=click.IntRange(min=1), help="New context size (n_ctx).")
@click.option("--cache-type", type=click.Choice(CACHE_TYPES), help="New K and V cache type.")
@click.option("--cache-type-k", type=click.Choice(CACHE_TYPES), help="New K cache type.")
@click.option("--cache-type-v", type=click.Choice(CACHE_TYPES), help="New V cache type.")
@click.option("--no-spec", is_flag=True, help="Turn speculative decoding off (drop the draft model flags).")
@click.option("--no-mmproj", is_flag=True, help="Drop the multimodal projector.")
@click.option("--set", "set_", multiple=True, metavar="FLAG[=VALUE]", help="Set a llama-server flag (repeatable).")
@click.option("--remove", multiple=True, metavar="FLAG", help="Remove a llama-server flag (repeatable).")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for the answer.")
@click.option("--json", "as_json", is_flag=True, help="Print the wrapper's whole answer as JSON.")
def reload(url: str, token_file: Path | None, config_path: Path | None, ctx: int | None, cache_type: str | None,
           cache_type_k: str | None, cache_type_v: str | None, no_spec: bool, no_mmproj: bool, set_: tuple[str, ...],
           remove: tuple[str, ...], timeout: float, as_json: bool) -> None:
    """Reconfigure the llama-server behind a running wrapper, keeping its conversations. Exit 1 if refused or
    rolled back."""
    named = token_file or _token_file_of(config_path)
    token, off = AdminToken(named, os.environ).read()
    if token is None and named is not None:
        raise click.UsageError(str(off))
    body: dict[str, Any] = {}
    if ctx is not None:
        body["n_ctx"] = ctx
    if cache_type_k or cache_type:
        body["cache_type_k"] = cache_type_k or cache_type
    if cache_type_v or cache_type:
        body["cache_type_v"] = cache_type_v or cache_type
    if no_spec:
        body["spec"] = {"types": ["none"]}
    if no_mmproj:
        body["mmproj"] = {"path": ""}
    if set_ or remove:
        body["args"] = {"set": dict(_assignment(item) for item in set_), "remove": list(remove)}
    if not body:
        raise click.UsageError("nothing to change: give --ctx, --cache-type, --set, --remove, --no-spec or --no-mmproj")
    if "://" not in url:  # 127.0.0.1:8080, as --listen takes it
        url = f"http://{url}"
    if not url.startswith(("http://", "https://")):
        raise click.UsageError(f"--url {url!r}: give the wrapper's address as http://HOST:PORT")
    request = urllib.request.Request(f"{url.rstrip('/')}/wrapper/reload", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as error:
        answer = json.loads(error.read() or b"{}")
    except (urllib.error.URLError, OSError) as exc:
        click.echo(f"llama-wrapper: cannot reach {url}: {getattr(exc, 'reason', exc)}", err=True)
        sys.exit(EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    elif "error" in answer:
        click.echo(f"llama-wrapper: refused: {answer['error'].get('message')}", err=True)
        if answer["error"].get("code") in (401, 403):
            click.echo(f"  the token: {_where_looked(token_file, config_path)}", err=True)
    elif answer.get("at_wake"):
        click.echo(answer["message"])
        for change in answer.get("changes") or []:
            click.echo(f"  {change}")
    else:
        click.echo(f"{answer['message']}: n_ctx {answer['n_ctx']}, downtime {answer['downtime_ms']:.0f} ms "
                   f"({'overlapped' if answer['overlap'] else 'sequential'}); {answer.get('restore') or ''}")
        for change in answer.get("changes") or []:
            click.echo(f"  {change}")
    sys.exit(0 if answer.get("success") else EXIT_FAILED)
