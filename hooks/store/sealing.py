"""What goes to the bucket, sealed (`store.encrypt: <key file>`): AES-256-GCM (the `cryptography` package), with one
data key per consumer derived from the file's secret by HKDF-SHA256, so that a bucket read by someone without the
key yields nothing — neither a state's KV nor its tokens (a manifest's token ids are sealed; its sizes, chunk names
and consumer stay readable, what a lookup needs before it fetches). Each object is sealed with its name as the
associated data: one cannot be passed off as another. Objects written without the key stay readable (they carry no
seal), and a wrong key is refused at the start, against the check object the first sealing host left there.

The names of entries and chunks are hashes of their tokens; sealed, they are keyed by the secret too, so that a
guessed conversation cannot be confirmed by computing its name."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hooks.store.interface import Unreadable

if TYPE_CHECKING:  # imported when a key is used: `cryptography` comes with the s3 extra
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"LWSEAL1\0"  # a sealed object begins with this, then its 12-byte nonce, then the ciphertext and its tag
NONCE = 12
CHECK_NAME = "sealed.json"
_CHECK = b"llama-wrapper store.encrypt: the key this bucket folder is sealed with"
MAKE_KEY = ("make one with: mkdir -p \"$(dirname {file})\" && python3 -c 'import secrets; "
            "print(secrets.token_urlsafe(32))' > {file} && chmod 600 {file}")


class WrongKey(Exception):
    """The bucket was sealed with another key."""


def read_secret(path: Path, named: str = "store.encrypt") -> bytes:
    """The key file's secret (its first line); ValueError saying how to make one (`named`: what gave the file)."""
    try:
        lines = path.read_text().strip().splitlines()
    except FileNotFoundError as exc:
        raise ValueError(f"{named}: {path} does not exist; {MAKE_KEY.format(file=path)}") from exc
    except OSError as exc:
        raise ValueError(f"{named}: cannot read {path}: {exc.strerror}") from exc
    secret = lines[0].strip().encode() if lines else b""
    if len(secret) < 16:
        raise ValueError(f"{named}: {path} holds {'nothing' if not secret else 'fewer than 16 characters'}; "
                         + MAKE_KEY.format(file=path))
    return secret


class Sealer:
    def __init__(self, secret: bytes) -> None:
        try:
            import cryptography  # noqa: F401
        except ImportError as exc:
            raise ValueError("store.encrypt needs the `cryptography` package: pip install 'llama-wrapper[s3]'") from exc
        self._secret = secret
        self._keys: dict[str | None, AESGCM] = {}
        self.names = self._derive(b"names").hex()  # what entry and chunk names are keyed with

    def _derive(self, info: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"llama-wrapper store.encrypt",
                    info=info).derive(self._secret)

    def _aead(self, owner: str | None) -> AESGCM:
        """One data key per consumer (`owner`: a private entry's), another for what is nobody's own."""
        if owner not in self._keys:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._keys[owner] = AESGCM(self._derive(b"shared" if owner is None else b"consumer\0" + owner.encode()))
        return self._keys[owner]

    def seal(self, data: bytes, owner: str | None, name: str) -> bytes:
        nonce = os.urandom(NONCE)
        return MAGIC + nonce + self._aead(owner).encrypt(nonce, data, name.encode())

    def open(self, data: bytes, owner: str | None, name: str) -> bytes:
        """The object's bytes: opened when sealed (Unreadable when another key sealed it), as they are when not."""
        if not data.startswith(MAGIC):
            return data
        from cryptography.exceptions import InvalidTag

        nonce = data[len(MAGIC):len(MAGIC) + NONCE]
        try:
            return self._aead(owner).decrypt(nonce, data[len(MAGIC) + NONCE:], name.encode())
        except InvalidTag as exc:
            raise Unreadable(f"{name} is sealed with another key") from exc

    def check(self) -> bytes:
        """The check object this key leaves in a bucket folder."""
        return self.seal(_CHECK, None, CHECK_NAME)

    def verify(self, check: bytes) -> None:
        """WrongKey when `check` was left by another key."""
        try:
            if self.open(check, None, CHECK_NAME) != _CHECK:
                raise WrongKey("the check object does not say what it should")
        except Unreadable as exc:
            raise WrongKey(str(exc)) from exc


def fingerprint(secret: bytes) -> str:
    """A short, one-way mark of a key, for the status and errors (never the key)."""
    return hashlib.sha256(b"llama-wrapper key fingerprint\0" + secret).hexdigest()[:12]
