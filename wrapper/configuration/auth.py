"""llama-server's API keys, as the wrapper's own endpoints check them, and secrets kept out of sight."""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from wrapper.configuration import argv as args

SECRET_OPTIONS = (args.API_KEY, ("-hft", "--hf-token"))
SECRET_ENV = ("LLAMA_API_KEY", "HF_TOKEN")
REDACTED = "<redacted>"


def server_keys(argv: Sequence[str], env: Mapping[str, str]) -> tuple[str, ...]:
    """The keys llama-server accepts, read as it reads them: `--api-key a,b`, `--api-key-file`, LLAMA_API_KEY."""
    keys: list[str] = []
    given = args.get(argv, args.API_KEY)
    if given is None and not args.has(argv, args.API_KEY):
        given = env.get("LLAMA_API_KEY")
    if given:
        keys += [key.strip() for key in given.split(",") if key.strip()]
    key_file = args.get(argv, args.API_KEY_FILE) or env.get("LLAMA_ARG_API_KEY_FILE")
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError:
            lines = []  # llama-server itself refuses to start then, and says why
        keys += [line for line in lines if line and not line.startswith("#")]
    return tuple(keys)


ADMIN_TOKEN_ENV = "LLAMA_WRAPPER_ADMIN_TOKEN"


MAKE_TOKEN = ("make one with: mkdir -p \"$(dirname {file})\" && python3 -c 'import secrets; "
              "print(secrets.token_urlsafe(32))' > {file} && chmod 600 {file}")


def admin_token(token_file: Path | None, env: Mapping[str, str]) -> str | None:
    """The token POST /wrapper/* asks for: admin.token_file's first line, else LLAMA_WRAPPER_ADMIN_TOKEN."""
    if token_file is not None:
        return _read_token(token_file)
    return env.get(ADMIN_TOKEN_ENV) or None


def _read_token(token_file: Path) -> str:
    try:
        lines = token_file.read_text().strip().splitlines()
    except FileNotFoundError as exc:
        raise ValueError(f"admin.token_file: {token_file} does not exist; {MAKE_TOKEN.format(file=token_file)}"
                         ) from exc
    except OSError as exc:
        raise ValueError(f"admin.token_file: cannot read {token_file}: {exc.strerror}") from exc
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"admin.token_file: {token_file} is empty; {MAKE_TOKEN.format(file=token_file)}")
    return token


def read_token(token_file: Path | None) -> str | None:
    """admin.read_token_file's token, read at each use (a file made or changed after the start counts); None when
    there is none or it cannot be read."""
    if token_file is None:
        return None
    try:
        return _read_token(token_file)
    except ValueError:
        return None


def token_path(text: str) -> Path:
    """admin.token_file as written in a config: `$VARS` and `~` expanded."""
    return Path(os.path.expandvars(text)).expanduser()


def default_token_file(env: Mapping[str, str]) -> Path:
    """Where docs/reload.md makes the token, and where the wrapper and `reload` look when nothing names one."""
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or "~").expanduser() / ".config")
    return Path(base) / "llama-wrapper" / "admin-token"


class AdminToken:
    """Where POST /wrapper/* finds its token: admin.token_file, else LLAMA_WRAPPER_ADMIN_TOKEN, else the default
    file when it exists. A file is read again at each use, so a token made (or changed) after the start counts."""

    def __init__(self, token_file: Path | None, env: Mapping[str, str]) -> None:
        self.token_file = token_file
        self.from_env = env.get(ADMIN_TOKEN_ENV) or None
        self.default_file = default_token_file(env)
        self.off: str | None = None  # why the last read found none (the listener logs when that ends)

    def read(self) -> tuple[str | None, str | None]:
        """(the token, None), or (None, why the admin endpoints are off and how to turn them on)."""
        token, self.off = self._read()
        return token, self.off

    @property
    def unused_env(self) -> str:
        """What to add to a refusal when LLAMA_WRAPPER_ADMIN_TOKEN is set but the config's file wins over it."""
        if self.token_file is None or not self.from_env:
            return ""
        return f" ({ADMIN_TOKEN_ENV} is set but not used: the config's admin.token_file, {self.token_file}, wins)"

    def _read(self) -> tuple[str | None, str | None]:
        if self.token_file is not None:
            try:
                return _read_token(self.token_file), None
            except ValueError as exc:
                return None, str(exc) + self.unused_env
        if self.from_env:
            return self.from_env, None
        if self.default_file.exists():
            try:
                return _read_token(self.default_file), None
            except ValueError as exc:
                return None, str(exc).replace("admin.token_file", "the default token file")
        make = MAKE_TOKEN.format(file=self.default_file).removeprefix("make one with: ")
        return None, (f"no admin token: set admin.token_file in the config or {ADMIN_TOKEN_ENV}, or make "
                      f"{self.default_file} ({make}); then send Authorization: Bearer <token>")


def presented(headers: Mapping[str, str]) -> str:
    """The key a request presents, read one way for everything a key decides (its consumer, a background key,
    llama-server's keys, the admin token): `Authorization: Bearer KEY` — the scheme in any case (RFC 9110), or left
    out as llama-server allows — else `X-Api-Key: KEY` (Anthropic's clients); spaces around it dropped. "" when
    none is presented."""
    auth = headers.get("Authorization", "").strip()
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() == "bearer":
        return rest.strip()
    return auth or headers.get("X-Api-Key", "").strip()


def as_llama_server_reads(headers: Mapping[str, str]) -> str | None:
    """The Authorization header to send llama-server for a request's key when it presented it in a form llama-server
    does not read (`bearer KEY`, spaces around it: llama-server takes `Bearer ` exactly); None when it reads it as
    sent."""
    auth = headers.get("Authorization")
    key = presented(headers)
    return f"Bearer {key}" if auth is not None and key and auth not in (key, f"Bearer {key}") else None


def allowed(keys: Sequence[str], presented: str) -> bool:
    """Whether `presented` is one of `keys`; every key is compared, each in constant time."""
    given = presented.encode()
    return any([hmac.compare_digest(given, key.encode()) for key in keys])  # a list: compare them all


def redacted(argv: Sequence[str]) -> list[str]:
    """`argv` with the values of secret options replaced, for status, logs and errors."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        secret = any(name in names for names in SECRET_OPTIONS)
        if secret and eq:
            out.append(f"{name}={REDACTED}")
        else:
            out.append(arg)
            hide_next = secret
    return out
