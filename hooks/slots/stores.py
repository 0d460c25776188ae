"""The store of each model's slot folder: opened once, by the slot built-ins' fit when a generation's argv names
the folder (never on a request), and kept for the wrapper's life (its listings, its sync with the bucket)."""

from __future__ import annotations

from pathlib import Path

from hooks.slots.settings import FAMILY
from hooks.store import Store
from hooks.store.interface import Shares
from hooks.store.layout import host_id
from hooks.store.opening import folder_only, open_store
from hooks.store.sealing import WrongKey
from hooks.store.settings import STORE
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.consumers import CONSUMERS
from wrapper.kept import Kept, Key
from wrapper.launching.launch import Launch
from wrapper.server.generation import Generation

_OPENED: Key[dict[Path, Store]] = Key("slots.stores", dict)


def open_for(shared: Kept, folder: Path, config: Config, local: bool = False) -> Store:
    """The folder's store, opened the first time a fit names the folder; `local`: the folder alone, whatever
    `store.url` says (`llama-wrapper plan` reads what this host saved, and asks no bucket)."""
    opened = shared.get(_OPENED)
    if folder not in opened:
        settings = STORE.of(config)
        try:
            opened[folder] = folder_only(folder) if local else open_store(folder, settings)
        except WrongKey as exc:
            raise ConfigError(f"store.encrypt: {settings.encrypt} is not the key {settings.url} was sealed with "
                              f"({exc}): name that key (after `llama-wrapper slots rekey`, the new key file), or give "
                              "this one another store.url prefix") from exc
        except ValueError as exc:  # the key file
            raise ConfigError(str(exc)) from exc
    return opened[folder]


def store_of(generation: Generation) -> Store | None:
    """The store of the generation's slot folder; None when the slot built-ins did not fit it (not in use)."""
    folder = generation.launch.fitted.get(FAMILY)
    return generation.shared.get(_OPENED).get(folder) if isinstance(folder, Path) else None


def noted_tokens(launch: Launch, shared: Kept) -> list[int]:
    """The tokens of each slot this host's note names (what its slots held at its last stop), for a fit before
    the start restores them: those the folder holds, and with a tier behind it those it may hold (the bucket is
    read once the server is up)."""
    folder = launch.fitted.get(FAMILY)
    store = shared.get(_OPENED).get(folder) if isinstance(folder, Path) else None
    if store is None:
        return []
    return [held.n_tokens for held in store.held(host_id()) if held.entry is not None or store.behind is not None]


def shares_of(config: Config) -> Shares | None:
    """What each consumer may keep in the folder and the bucket (`consumers.shares`); None when no share is given."""
    settings = CONSUMERS.of(config)
    folder = {name: share.folder for name, share in settings.shares if share.folder is not None}
    bucket = {name: share.bucket for name, share in settings.shares if share.bucket is not None}
    return Shares(folder, bucket) if folder or bucket else None
