"""The slot built-ins' section of the config (`slots:`): the folder, the sliding-window rule, the warm-up after a
start, and the object-store tier behind the folder (`slots.store`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from hooks.cachesettings import MOVED
from hooks.store.bucket import Bucket, check_endpoint, parse_url
from wrapper.settings import COUNT, DURATION, PATH, Kind, Section, choice, setting
from wrapper.yamlread import Reader

FAMILY = "slots"


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


TEXT = Kind("text", _text)
ENDPOINT = Kind("http(s) URL", _checked(check_endpoint))
SECRET = Kind("text (secret)", _text, lambda v: "(set)" if v else None)
STORE_URL = Kind("s3://BUCKET/PREFIX", _checked(parse_url))


@dataclass(frozen=True)
class SlotSettings:
    dir: Path = setting(Path("~/.cache/llama-wrapper/slots").expanduser(), PATH,
                        "where slot files are kept, one folder per model id (also `--slots-dir`)")
    swa_full: str = setting("auto", choice("auto", "always", "never"),
                            "add `--swa-full` so that restored slots of sliding-window models are reused")
    warm: int = setting(16, COUNT, "after a start, prefill at most this many slots `slots.restore` could not use "
                        "(saved by another build that does not convert, or in other cache types), one at a time "
                        "while no request is in flight; 0: none (their next turn prefills them)")
    store: str | None = setting(None, STORE_URL, "an S3-compatible object store behind the folder: every saved "
                                "conversation is uploaded there in the background and found by any wrapper on it")
    store_endpoint: str | None = setting(None, ENDPOINT, "the store's endpoint URL (else `AWS_ENDPOINT_URL`, else "
                                         "AWS)")
    store_region: str | None = setting(None, TEXT, "its region (else `AWS_REGION` / `AWS_DEFAULT_REGION`)")
    store_access_key: str | None = setting(None, SECRET, "its access key id (else `AWS_ACCESS_KEY_ID`, ~/.aws, "
                                           "a role); never shown")
    store_secret_key: str | None = setting(None, SECRET, "its secret key (else `AWS_SECRET_ACCESS_KEY`, ...); "
                                           "never shown")
    store_refresh: float = setting(5.0, DURATION, "how often the store's list of conversations is read again "
                                   "(what other wrappers uploaded is found this soon)")
    store_flush: float = setting(5.0, DURATION, "at a drain or a stop, upload what is left for at most this long "
                                 "(it counts in the stop's time: raise it with the drain's budget)")
    store_timeout: float = setting(10.0, DURATION, "one request to the store gives up after this long")


SLOTS = Section(FAMILY, SlotSettings, "slot persistence (`slots.save`, `slots.restore`)", moved=MOVED)


def bucket_for(settings: SlotSettings) -> Bucket:
    """The bucket `slots.store` names, with the config's endpoint and credentials (else boto3's usual chain);
    BucketError or ValueError when it cannot be set up."""
    assert settings.store
    return Bucket(settings.store, endpoint=settings.store_endpoint, region=settings.store_region,
                  access_key=settings.store_access_key, secret_key=settings.store_secret_key,
                  timeout_s=settings.store_timeout)
