"""The `degrade:` section, declared once: its keys, their kinds, defaults and docs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hooks.degrade import FAMILY
from wrapper.configuration.settings import BOOL, COUNT, DURATION, PATH, SIZE, SIZE_OR_AUTO, Kind, Section, setting
from wrapper.configuration.yamlread import Reader, suggest

LADDER_RUNGS = ("disable-spec", "mmproj-to-cpu", "quantize-kv-q8", "quantize-kv-q4", "swa-window")


@dataclass(frozen=True)
class Rung:
    """A step of the degradation ladder: a built-in one by name, or the user's own argv edits."""

    name: str
    set: dict[str, str | bool] = field(default_factory=dict)
    remove: tuple[str, ...] = ()


def _read_ladder(r: Reader, node: yaml.Node, what: str) -> tuple[Rung, ...] | None:
    if not isinstance(node, yaml.SequenceNode):
        r.error(node, f"{what} must be a list of rungs ({', '.join(LADDER_RUNGS)}, or {{name, set, remove}})")
        return None
    rungs: list[Rung] = []
    for index, item in enumerate(node.value):
        where = f"{what}[{index}]"
        if isinstance(item, yaml.ScalarNode):
            known = str(item.value)
            if known not in LADDER_RUNGS:
                r.error(item, f"{where}: unknown rung {known!r}{suggest(known, LADDER_RUNGS)}; "
                              "a rung of your own is a mapping {name, set, remove}")
            rungs.append(Rung(known))
            continue
        keys = r.mapping(item, where, ("name", "set", "remove"))
        name = r.scalar(keys["name"], f"{where}.name", (str,)) if "name" in keys else None
        if not name:
            r.error(item, f"{where} needs a name")
            continue
        if name in LADDER_RUNGS:
            r.error(item, f"{where}: {name!r} is a built-in rung; give yours another name")
        edits = r.value(keys["set"]) if "set" in keys else {}
        if not isinstance(edits, dict) or not all(str(k).startswith("-") for k in edits):
            r.error(keys.get("set", item), f"{where}.set must map llama-server flags to values, e.g. {{-ub: 256}}")
            edits = {}
        removed = r.string_list(keys["remove"], f"{where}.remove") if "remove" in keys else ()
        if not edits and not removed:
            r.error(item, f"{where} changes nothing: give set or remove")
        rungs.append(Rung(name, {str(k): v if isinstance(v, bool) else str(v) for k, v in edits.items()},
                          tuple(removed)))
    names = [rung.name for rung in rungs]
    for name in {n for n in names if names.count(n) > 1}:
        r.error(node, f"{what} names {name!r} twice")
    return tuple(rungs)


def _show_ladder(ladder: tuple[Rung, ...]) -> list[Any]:
    return [r.name if not (r.set or r.remove) else {"name": r.name, "set": r.set, "remove": list(r.remove)}
            for r in ladder]


LADDER = Kind("list of rungs", _read_ladder, _show_ladder)
OPTIONAL_PATH = Kind("path", PATH.read, lambda v: "none" if v is None else str(v))


@dataclass(frozen=True)
class DegradeSettings:
    budget: int | None = setting(None, SIZE_OR_AUTO, "memory for the server: a size, or `auto` (free memory of "
                                 "the first GPU when layers are offloaded, else MemAvailable minus `reserve`)")
    reserve: int = setting(1 << 30, SIZE, "what `auto` leaves to the rest of the machine (CPU only)")
    ladder: tuple[Rung, ...] = setting(tuple(Rung(name) for name in LADDER_RUNGS), LADDER,
                                       "the rungs in order: built-in names, or `{name, set, remove}` of your own")
    headroom: int = setting(1024, COUNT, "tokens beyond a prompt that asks for no max_tokens")
    continue_truncated: bool = setting(True, BOOL, "an answer cut by a full context goes on after a growth",
                                       key="continue")
    relax_after: float = setting(600.0, DURATION, "idle this long, move back up to the best rung that fits")
    pool: Path | None = setting(None, OPTIONAL_PATH, "a folder the wrappers of one device share (e.g. "
                                "`/run/llama-wrapper/gpu0`): `budget` is then the pool's total, and a member that "
                                "needs more asks the others to give it up")
    context: int = setting(4096, COUNT, "with a pool: the context a member takes at a start and relaxes back to "
                           "(a growth goes beyond it, up to `-c` or the training context)")
    pool_wait: float = setting(60.0, DURATION, "with a pool: how long a member waits (its client held) for the "
                               "others to give what it asked")


DEGRADE = Section(FAMILY, DegradeSettings, "degradation under a memory budget", optional=True)
