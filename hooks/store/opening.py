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
    """The store, and why the object store could not be set up (the folder alone then)."""
    folder = DirectoryStore(directory, chunk_tokens=settings.chunk_tokens)
    if not settings.url:
        return folder, None
    try:
        bucket = bucket_for(settings)
    except (BucketError, ValueError) as exc:
        return folder, str(exc)
    return TieredStore(folder, Remote(bucket, directory.name), host_id(), settings.refresh), None


def folder_only(directory: Path) -> Store:
    """The slot folder alone, whatever the config names behind it (what `slots inspect` and `slots rm` read)."""
    return DirectoryStore(directory)
