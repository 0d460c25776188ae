"""The store's section of the config (`store:`): what the slot folder may hold on disk, how a state is cut into
chunks, and the object store behind the folder (`store.url`). Its keys were `slots.store*` and `cache.budget`,
`cache.entry_max`, `cache.min_free`, `cache.chunk_tokens`: those now fail with the name of the new key
(MOVED_FROM_SLOTS, MOVED_FROM_CACHE)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from hooks.store.bucket import Bucket, check_endpoint, parse_url
from hooks.store.sealing import read_secret
from wrapper.configuration.settings import (
    COUNT,
    DURATION,
    PATH,
    POSITIVE_DURATION,
    SIZE,
    HasSettings,
    Kind,
    Section,
    setting,
)
from wrapper.configuration.yamlread import Reader


def _text(r: Reader, node: yaml.Node, what: str) -> str | None:
    value = r.scalar(node, what, (str,))
    return str(value) if value else None


def _checked(check: Callable[[str], object]) -> Callable[[Reader, yaml.Node, str], str | None]:
    """A text the `check` accepts (its ValueError is the load's error, with file, line and key)."""
    def read(r: Reader, node: yaml.Node, what: str) -> str | None:
        if not r.value(node):
            return None
        value = r.converted(node, what, lambda v: (check(str(v)), str(v))[1])
        return str(value) if value is not None else None
    return read


def _secret(r: Reader, node: yaml.Node, what: str) -> str | None:
    """A text never echoed, also not in an error (an unquoted all-digit password is a YAML number)."""
    if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:str":
        kind = "a list" if isinstance(node, yaml.SequenceNode) else "a mapping" if isinstance(
            node, yaml.MappingNode) else "not a string"
        r.error(node, f"{what} must be a string, and this is {kind} (its value is not shown): quote it, "
                      f"e.g. {what.rsplit('.', 1)[-1]}: \"...\"")
        return None
    return str(node.value) or None


TEXT = Kind("text", _text)
ENDPOINT = Kind("http(s) URL", _checked(check_endpoint))
SECRET = Kind("text (secret)", _secret, lambda v: "(set)" if v else None)
STORE_URL = Kind("s3://BUCKET/PREFIX", _checked(parse_url))
KEY_FILE = Kind("path", PATH.read, lambda v: str(v) if v is not None else None)


@dataclass(frozen=True)
class StoreSettings:
    budget: int = setting(20 << 30, SIZE, "what the slot folder's saved states may take on disk: the least "
                          "recently used conversations go first")
    entry_max: int = setting(4 << 30, SIZE, "a conversation larger than this is not kept")
    min_free: int = setting(2 << 30, SIZE, "no conversation is written when less than this is free on disk")
    chunk_tokens: int = setting(256, COUNT, "a conversation is kept as chunks of this many tokens, each written "
                                "once: a new turn writes only the chunks it adds, and conversations with the same "
                                "beginning share it (0: each state whole)")
    url: str | None = setting(None, STORE_URL, "an S3-compatible object store behind the folder: every saved "
                              "conversation is uploaded there in the background and found by any wrapper on it")
    endpoint: str | None = setting(None, ENDPOINT, "the object store's endpoint URL (else `AWS_ENDPOINT_URL`, else "
                                   "AWS)")
    region: str | None = setting(None, TEXT, "its region (else `AWS_REGION` / `AWS_DEFAULT_REGION`)")
    access_key: str | None = setting(None, SECRET, "its access key id (else `AWS_ACCESS_KEY_ID`, ~/.aws, a role); "
                                     "never shown")
    secret_key: str | None = setting(None, SECRET, "its secret key (else `AWS_SECRET_ACCESS_KEY`, ...); never shown")
    refresh: float = setting(5.0, POSITIVE_DURATION, "how often the object store's list of conversations is read again "
                             "(what other wrappers uploaded is found this soon)")
    flush: float = setting(5.0, DURATION, "at a drain or a stop, upload what is left for at most this long (it "
                           "counts in the stop's time: raise it with the drain's budget)")
    timeout: float = setting(10.0, POSITIVE_DURATION, "one request to the object store gives up after this long")
    encrypt: Path | None = setting(None, KEY_FILE, "a key file (its first line, 16 characters or more): what goes to "
                                   "the object store is sealed with AES-256-GCM, one key per consumer derived from it, "
                                   "so that the bucket read without it yields nothing; entries written without it stay "
                                   "readable, and another key is refused at the start")


MOVED_FROM_SLOTS = {"store": "store.url", **{f"store_{key}": f"store.{key}" for key in (
    "endpoint", "region", "access_key", "secret_key", "refresh", "flush", "timeout")}}  # slots.<key> ->
MOVED_FROM_CACHE = {key: f"store.{key}" for key in ("budget", "entry_max", "min_free", "chunk_tokens")}  # cache.<key>
STORE = Section("store", StoreSettings, "where saved states are kept: the slot folder, and an object store behind it",
                written="{url: s3://BUCKET/PREFIX}")


def bucket_for(settings: StoreSettings) -> Bucket:
    """The bucket `store.url` names, with the config's endpoint and credentials (else boto3's usual chain);
    BucketError or ValueError when it cannot be set up."""
    assert settings.url
    return Bucket(settings.url, endpoint=settings.endpoint, region=settings.region,
                  access_key=settings.access_key, secret_key=settings.secret_key, timeout_s=settings.timeout)


def store_warnings(config: HasSettings) -> list[str]:
    """What `check` and a start say of `store.encrypt`: a key file that cannot be read (the start then fails), a key
    with no object store to seal for."""
    settings = STORE.of(config)
    if settings.encrypt is None:
        return []
    if not settings.url:
        return ["store.encrypt: there is no store.url: nothing goes to an object store, so nothing is sealed (the "
                "slot folder never is)"]
    try:
        read_secret(settings.encrypt)
    except ValueError as exc:
        return [f"{exc} (a start fails until it does)"]
    return []
