"""`llama-wrapper slots ls|inspect|rm|rekey`: the slot folder and the bucket behind it, without a server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import structlog

from hooks import kvfile
from hooks.slots.settings import SLOTS
from hooks.store import Entry, Store, Unreadable, layout
from hooks.store.bucket import BucketError
from hooks.store.opening import folder_only, opened
from hooks.store.rekey import rekey, sealed_folders
from hooks.store.sealing import Sealer, WrongKey, read_secret
from hooks.store.settings import STORE, StoreSettings, bucket_for
from wrapper.configuration import consumers
from wrapper.configuration.config import Config, ConfigError, parse_config
from wrapper.configuration.consumers import CONSUMERS
from wrapper.configuration.exits import EXIT_CONFIG, EXIT_FAILED
from wrapper.launching.commands import Commands

LOOK_S = 10.0  # how long `ls` waits for the bucket's manifests


def _config(config_path: str | None) -> Config:
    commands = click.get_current_context().find_object(Commands)
    try:
        return commands.load(config_path) if commands else parse_config("", "<defaults>", (SLOTS, STORE))
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_CONFIG)


def _slots_dir(directory: str | None, config_path: str | None) -> Path:
    if directory:
        return Path(directory).expanduser()
    return SLOTS.of(_config(config_path)).dir


def _stores(root: Path, config_path: str | None) -> list[Store]:
    """The store of each model folder of this host, opened as the wrapper opens it: with a config whose
    `store.url` names a bucket, the folder in front of it (its manifests listed once)."""
    settings = STORE.of(_config(config_path)) if config_path else StoreSettings()
    folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if settings.url:  # a model the bucket holds and this host never served (the host a conversation moves to)
        folders = sorted({*folders, *(root / name for name in _bucket_folders(settings))})
    stores = []
    for folder in folders:
        try:
            store, problem = opened(folder, settings)
        except (ValueError, WrongKey) as exc:  # store.encrypt's key file, or another key than the bucket's
            raise click.ClickException(str(exc) if not isinstance(exc, WrongKey) else
                                       f"store.encrypt: another key sealed {settings.url} ({exc})") from exc
        if problem is not None:  # the folder is still listed: WHERE says `local` only
            click.echo(f"llama-wrapper: the store is not listed: {problem}", err=True)
            return [folder_only(f) for f in folders]
        with _quiet():
            asyncio.run(store.first_look(LOOK_S))
        tiers = store.status()
        if tiers is not None and tiers["store"]["state"] != "up":
            click.echo(f"llama-wrapper: the store is not listed: {tiers['store']['error']}", err=True)
            return [folder_only(f) for f in folders]
        stores.append(store)
    return stores


def _bucket_folders(settings: StoreSettings) -> list[str]:
    try:
        with _quiet():
            return [name for name in bucket_for(settings).folders() if name not in ("", ".", "..")]
    except (BucketError, ValueError) as exc:
        click.echo(f"llama-wrapper: the store's models are not listed: {exc}", err=True)
        return []


_DIR = click.option("--dir", "directory", type=click.Path(file_okay=False), envvar="LLAMA_WRAPPER_SLOTS_DIR",
                    show_envvar=True, help="The slot folder [default: slots.dir of --config, else "
                                           "~/.cache/llama-wrapper/slots].")
_CONFIG = click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="LLAMA_WRAPPER_CONFIG",
                       show_envvar=True, help="Read slots.dir from this config.")


@click.group()
def slots() -> None:
    """List, inspect and remove saved slot files."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The store's log lines are the wrapper's: a listing says what went wrong itself."""
    saved = structlog.get_config()
    structlog.configure(processors=[_drop])
    try:
        yield
    finally:
        structlog.configure(**saved)


def _drop(logger: Any, name: str, event: Any) -> Any:
    raise structlog.DropEvent


def _rows(stores: list[Store]) -> list[dict[str, Any]]:
    rows = []
    for store in stores:
        folder = store.directory
        for saved in layout.legacy_slots(folder):
            row: dict[str, Any] = {"model_id": folder.name, "slot": saved.slot, "file": str(saved.kv_file),
                                   "bytes": saved.kv_file.stat().st_size if saved.kv_file.exists() else 0}
            try:
                sidecar = layout.read_sidecar(saved.sidecar)
                row.update(model=sidecar["model"].get("name"), tokens=sidecar.get("tokens"),
                           saved_at=sidecar.get("saved_at"), build=sidecar.get("build"),
                           cache_types=f"{sidecar.get('cache_type_k')}/{sidecar.get('cache_type_v')}")
                layout.check_pair(sidecar, saved.kv_file)
            except (layout.SidecarError, KeyError, AttributeError) as exc:
                row["problem"] = f"sidecar: {exc}"
            rows.append(row)
        held = {h.key: h.slot for h in store.held(layout.host_id()) if h.entry is not None and h.entry.by_content}
        for entry in sorted(store.entries(), key=lambda e: (held.get(e.key, 1 << 30), -e.last_used)):
            row = _entry_row(folder, entry, held.get(entry.key, "conv"), store.where(entry))
            if (problem := store.problem(entry)) is not None:
                row["problem"] = problem
            rows.append(row)
        for noted in store.held(layout.host_id()):  # a note naming a sidecar no lookup is offered, or none
            if noted.entry is not None and noted.entry.problem is not None:
                rows.append({**_entry_row(folder, noted.entry, noted.slot, "local"), "tokens": noted.n_tokens,
                             "problem": noted.entry.problem})
            elif noted.entry is None:
                rows.append({"model_id": folder.name, "slot": noted.slot, "entry": noted.key, "tokens": noted.n_tokens,
                             "bytes": 0, "where": "gone", "file": str(layout.entry_sidecar(folder, noted.key)),
                             "problem": f"no sidecar: the state this slot held ({noted.key}) is gone (evicted, "
                                        "replaced by a longer state of its conversation, or removed)"})
    return rows


def _entry_row(folder: Path, entry: Entry, slot: int | str, where: str) -> dict[str, Any]:
    chunks = entry.record.get("chunks")
    return {"model_id": folder.name, "slot": slot, "entry": entry.key, "file": str(folder / entry.name),
            "bytes": entry.bytes, "tokens": entry.n_tokens, "where": where,
            "chunks": chunks.get("count") if isinstance(chunks, dict) else 0,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(entry.last_used)),
            "model": entry.record.get("model", {}).get("name"),
            "cache_types": f"{entry.record.get('cache_type_k')}/{entry.record.get('cache_type_v')}",
            **({"consumer": entry.consumer} if entry.consumer is not None else {})}


@slots.command("ls")
@_DIR
@_CONFIG
@click.option("--json", "as_json", is_flag=True, help="One JSON object per slot file.")
def list_slots(directory: str | None, config_path: str | None, as_json: bool) -> None:
    """List saved states per model: those this host's slots held at its last stop (SLOT), the other cached
    conversations (`conv`); tokens, size, when (for entries, SAVED is their last use), WHERE they are (`local`,
    and with a config whose `store.url` names a bucket: `store` or `both`)."""
    root = _slots_dir(directory, config_path)
    rows = _rows(_stores(root, config_path))
    if config_path and consumers.on(CONSUMERS.of(_config(config_path))):
        for row in rows:  # kept before `consumers:` named whose: under isolation no request may reuse it
            if "entry" in row and "consumer" not in row:
                row["nobodys"] = True
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo(f"no saved slots in {root}")
        return
    table = [(str(row["model_id"]), str(row["slot"]), str(row.get("tokens", "?")), f"{row['bytes'] / 1e6:.1f} MB",
              str(row.get("cache_types", "?")), str(row.get("where", "local")), _whose(row), Path(row["file"]).name,
              str(row.get("model", "?")), str(row.get("problem") or row.get("saved_at"))) for row in rows]
    header = ("MODEL ID", "SLOT", "TOKENS", "SIZE", "K/V", "WHERE", "WHOSE", "FILE", "MODEL", "SAVED")
    widths = [max(len(cells[i]) for cells in (header, *table)) for i in range(len(header) - 1)]
    right = {1, 2, 3}  # numbers
    for cells in (header, *table):  # SAVED last: a problem there may be long
        click.echo(" ".join(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
                            for i, cell in enumerate(cells[:-1])) + " " + cells[-1])
    click.echo(f"\n{root}/<model id>/<file> is what `llama-wrapper slots inspect` reads")


def _whose(row: dict[str, Any]) -> str:
    """The consumer an entry is of; `nobody's` for one kept before `consumers:` named it (a config with consumers)."""
    return str(row.get("consumer") or ("nobody's" if row.get("nobodys") else "-"))


@slots.command()
@click.argument("path", type=click.Path(dir_okay=False))
def inspect(path: str) -> None:
    """Read a slot file's header (tokens, cells, layers, K/V types, streams) and its sidecar. Exit 1 when there is
    no such file or it is not a slot file."""
    if not Path(path).is_file():
        click.echo(f"llama-wrapper: no such slot file: {path} (`llama-wrapper slots ls` lists them)", err=True)
        sys.exit(EXIT_FAILED)
    try:
        summary = kvfile.read(path).summary()
    except kvfile.SlotFileError as exc:
        click.echo(f"llama-wrapper: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    for saved in layout.legacy_slots(Path(path).parent):
        if saved.kv_file.name == Path(path).name:
            try:
                summary["sidecar"] = layout.read_sidecar(saved.sidecar)
            except layout.SidecarError as exc:
                summary["sidecar"] = f"unreadable: {exc}"
    store = folder_only(Path(path).parent)
    for entry in store.entries():
        if entry.name == Path(path).name:
            summary["sidecar"] = entry.record
            if (problem := store.problem(entry)) is not None:
                summary["problem"] = problem
    if "sidecar" not in summary and Path(path).name.startswith(layout.ENTRY_PREFIX):
        summary["problem"] = ("no sidecar names this file: it is no entry (a chunked state's tail without its "
                              "manifest says nothing of its chunks); the next start sweeps it")
    sidecar = summary.get("sidecar")
    if isinstance(sidecar, dict) and sidecar.get("bytes") not in (None, summary.get("bytes")):
        summary["bytes_are"] = ("`bytes`: this file (a chunked state's tail: the cells after its last whole chunk); "
                                "`sidecar.bytes`: the whole state it makes with the chunks the sidecar names")
    click.echo(folded(summary))


def _plain(value: Any) -> bool:
    """A value written inline: not a mapping, and a list only when short and flat (a layer's `[1, 384]`)."""
    if isinstance(value, list):
        return all(not isinstance(v, (dict, list)) for v in value) and len(json.dumps(value)) <= 24
    return not isinstance(value, dict)


def folded(value: Any, indent: int = 0, width: int = 116) -> str:
    """JSON as `json.dumps(indent=2)` writes it, but a list of plain values on as few lines as fit `width`."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        items = [f"{pad}  {json.dumps(k)}: {folded(v, indent + 2, width).lstrip()}" for k, v in value.items()]
        return pad + "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and all(_plain(v) for v in value):
        lines, line = [], ""
        for text in (json.dumps(v) for v in value):
            if line and len(pad) + 2 + len(line) + len(text) + 2 > width:
                lines.append(line)
                line = ""
            line = f"{line} {text}," if line else f"{text},"
        lines.append(line.rstrip(","))
        return pad + "[\n" + "\n".join(f"{pad}  {each}" for each in lines) + f"\n{pad}]"
    if isinstance(value, list) and value:
        return pad + "[\n" + ",\n".join(folded(v, indent + 2, width) for v in value) + f"\n{pad}]"
    return pad + json.dumps(value)


def _ids_hint(root: Path, asked: str) -> str:
    """The model ids of the folder (MODEL ID in `slots ls`), those whose model's name contains `asked` first."""
    names = {row["model_id"]: str(row.get("model") or "?") for row in _rows([folder_only(p) for p in sorted(
        root.iterdir()) if p.is_dir()])} if root.is_dir() else {}
    if not names:
        return " (it holds none)"
    matching = [i for i, name in names.items() if asked and asked.lower() in name.lower()]
    shown = matching or list(names)
    return (f"; {'its model id is' if len(matching) == 1 else 'model ids'}: "
            + ", ".join(f"{i} ({names[i]})" for i in shown[:10]) + (" …" if len(shown) > 10 else ""))


@slots.command("rm")
@_DIR
@_CONFIG
@click.argument("model_id")
@click.option("--slot", type=int, help="Only this slot [default: every slot of the model].")
def remove(directory: str | None, config_path: str | None, model_id: str, slot: int | None) -> None:
    """Remove the saved slots of MODEL_ID (as `slots ls` shows it)."""
    folder = _slots_dir(directory, config_path) / model_id
    if "/" in model_id or model_id in ("", ".", "..") or not folder.is_dir():
        click.echo(f"llama-wrapper: no saved slots for model id {model_id!r} in {folder.parent}"
                   f"{_ids_hint(folder.parent, model_id)}", err=True)
        sys.exit(EXIT_FAILED)
    legacy = [saved for saved in layout.legacy_slots(folder) if slot is None or saved.slot == slot]
    store = folder_only(folder)
    noted = [h for h in store.held(layout.host_id()) if h.entry is not None and h.entry.by_content
             and (slot is None or h.slot == slot)]
    if not legacy and not noted:
        click.echo(f"llama-wrapper: model {model_id} has no saved slot {slot}" if slot is not None
                   else f"llama-wrapper: model {model_id} has no saved slots", err=True)
        sys.exit(EXIT_FAILED)
    for saved in legacy:
        for file in layout.remove(saved):
            click.echo(f"removed {file}")
    for held in noted:
        assert held.entry is not None
        store.remove(held.entry)
        click.echo(f"removed {folder / held.entry.name} (slot {held.slot})")
    layout.drop_from_notes(folder, {h.key for h in noted})


@slots.command("rekey")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), envvar="LLAMA_WRAPPER_CONFIG",
              show_envvar=True, required=True,
              help="The config whose store.url is the bucket and whose store.encrypt is the key it is sealed with now.")
@click.option("--new-key", "new_key", type=click.Path(dir_okay=False, exists=True), required=True,
              help="The key file to seal it with from now on (its first line, 16 characters or more).")
def rekey_bucket(config_path: str, new_key: str) -> None:
    """Seal the bucket again under a new key: every model folder of store.url that store.encrypt's key sealed.

    The folder's check object is the new key's first (a wrapper started with the old key is refused from then on),
    then each entry is sealed again and its old objects deleted. Safe to interrupt: run it again to go on. Stop or
    drain the hosts first, then set store.encrypt to the new key file on each and start them again."""
    settings = STORE.of(_config(config_path))
    if not settings.url or settings.encrypt is None:
        raise click.ClickException(f"{config_path} has no store.url with store.encrypt: there is no sealed bucket "
                                   "to seal again")
    try:
        old = Sealer(read_secret(settings.encrypt))
        new = Sealer(read_secret(Path(new_key).expanduser(), "--new-key"))
        if old.names == new.names:
            raise ValueError(f"{new_key} holds the key the bucket is sealed with now: make a new one")
        bucket = bucket_for(settings)
        with _quiet():
            folders = sealed_folders(bucket)
        if not folders:
            click.echo(f"llama-wrapper: {settings.url} holds no sealed model folder: nothing to do", err=True)
        for folder in folders:
            def told(done: int, total: int, folder: str = folder) -> None:
                click.echo(f"{folder}: {done} of {total} entries sealed again", err=True)

            def skipped(key: str, why: str, folder: str = folder) -> None:
                click.echo(f"{folder}: conv-{key} is left as it is (not sealed again): {why}", err=True)

            with _quiet():
                done = rekey(bucket, folder, old, new, settings.chunk_tokens, told, skipped)
            click.echo(json.dumps(done.as_dict()))
    except (ValueError, WrongKey) as exc:
        raise click.ClickException(str(exc) if not isinstance(exc, WrongKey) else
                                   f"neither key sealed {settings.url}: {exc}") from exc
    except (BucketError, Unreadable, OSError) as exc:
        raise click.ClickException(f"{exc}; what was done is kept: run it again to go on") from exc
    except KeyboardInterrupt:
        raise click.ClickException("interrupted: what was done is kept: run it again to go on") from None
    click.echo(f"llama-wrapper: done. Set store.encrypt to {new_key} on every host (the old key is refused now).",
               err=True)
