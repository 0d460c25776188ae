"""The one way a store is opened: the slot folder, in front of the object store `store.url` names when it can be
set up (else the folder alone, and the log says why)."""

from __future__ import annotations

from pathlib import Path

import structlog

from hooks.store.bucket import BucketError
from hooks.store.folder import DirectoryStore
from hooks.store.interface import Store
from hooks.store.layout import host_id
from hooks.store.remote import Remote
from hooks.store.sealing import Sealer, read_secret
from hooks.store.settings import StoreSettings, bucket_for
from hooks.store.tiered import TieredStore

log = structlog.get_logger()


def open_store(directory: Path, settings: StoreSettings) -> Store:
    """The store of one model's slot folder."""
    store, problem = opened(directory, settings)
    if problem is not None:
        log.error("store.unusable", store=settings.url, error=problem, hint="serving from the slot folder alone")
    return store


def opened(directory: Path, settings: StoreSettings) -> tuple[Store, str | None]:
    """The store, and why the object store could not be set up (the folder alone then). With `store.encrypt`,
    ValueError when its key file cannot be read, WrongKey when the bucket was sealed with another key."""
    sealer = Sealer(read_secret(settings.encrypt)) if settings.url and settings.encrypt is not None else None
    folder = DirectoryStore(directory, chunk_tokens=settings.chunk_tokens,
                            names=sealer.names if sealer is not None else None)
    if not settings.url:
        return folder, None
    try:
        bucket = bucket_for(settings)
    except (BucketError, ValueError) as exc:
        return folder, str(exc)
    remote = Remote(bucket, directory.name, sealer)
    store = TieredStore(folder, remote, host_id(), settings.refresh)
    if sealer is not None:
        store.key_checked = False
        try:
            remote.check_key()  # WrongKey: the start fails, saying so
        except BucketError as exc:  # not known yet: checked at the first look that reaches the bucket
            log.warning("store.key_unchecked", store=remote.describe(), error=str(exc),
                        hint="the key is checked once the bucket answers; nothing is uploaded or fetched before")
        else:
            store.key_checked = True
    return store, None


def folder_only(directory: Path) -> Store:
    """The slot folder alone, whatever the config names behind it (what `slots inspect` and `slots rm` read)."""
    return DirectoryStore(directory)
