"""A built-in's section of the config, declared once in the built-in's own module: a frozen dataclass whose
fields carry their YAML key, kind (how a value is read and shown) and a one-line doc. The loader, `check`, the
file:line errors and the table of docs/configuration.md all come from that declaration.

    @dataclass(frozen=True)
    class SlotSettings:
        dir: Path = setting(Path("~/.cache/..."), PATH, "where slot files are kept")

    SLOTS = Section("slots", SlotSettings, "slot persistence")
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import yaml

from wrapper.configuration.units import format_size, parse_duration, parse_size
from wrapper.configuration.yamlread import Reader

T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """How a setting's value is read from YAML (None after reporting the error) and shown by `check`."""

    name: str
    read: Callable[[Reader, yaml.Node, str], Any]
    show: Callable[[Any], Any] = lambda value: value


def _scalar(*kinds: type) -> Callable[[Reader, yaml.Node, str], Any]:
    return lambda r, node, what: r.scalar(node, what, kinds)


def _converted(convert: Callable[[Any], Any]) -> Callable[[Reader, yaml.Node, str], Any]:
    return lambda r, node, what: r.converted(node, what, convert)


def _path(r: Reader, node: yaml.Node, what: str) -> Path | None:
    text = r.scalar(node, what, (str,))
    return Path(os.path.expandvars(text)).expanduser() if text else None


def _count(r: Reader, node: yaml.Node, what: str) -> int | None:
    value = r.scalar(node, what, (int,))
    if value is not None and value < 0:
        r.error(node, f"{what} must be 0 or more")
        return None
    return value  # type: ignore[no-any-return]


def choice(*options: str) -> Kind:
    def read(r: Reader, node: yaml.Node, what: str) -> str | None:
        value = r.scalar(node, what, (str,))
        if value is not None and value not in options:
            r.error(node, f"{what} must be one of {', '.join(options)}, not {value!r}")
            return None
        return value  # type: ignore[no-any-return]

    return Kind(" | ".join(options), read)


def _size_or_auto(r: Reader, node: yaml.Node, what: str) -> int | None:
    return None if r.value(node) == "auto" else r.converted(node, what, parse_size)


def _positive_duration(r: Reader, node: yaml.Node, what: str) -> float | None:
    value = r.converted(node, what, parse_duration)
    if value is not None and not value > 0:
        r.error(node, f"{what} must be more than 0s")
        return None
    return float(value) if value is not None else None


def _positive(r: Reader, node: yaml.Node, what: str) -> float | None:
    value = r.scalar(node, what, (int, float))
    if value is not None and not value > 0:
        r.error(node, f"{what} must be more than 0")
        return None
    return float(value) if value is not None else None


def _fraction(r: Reader, node: yaml.Node, what: str) -> float | None:
    value = r.scalar(node, what, (int, float))
    if value is not None and not 0 <= value < 1:
        r.error(node, f"{what} must be at least 0 and below 1 (a share: 0.05 is 5 %)")
        return None
    return float(value) if value is not None else None


BOOL = Kind("boolean", _scalar(bool))
NUMBER = Kind("number > 0", _positive)
FRACTION = Kind("number in [0, 1)", _fraction)
COUNT = Kind("integer ≥ 0", _count)
DURATION = Kind("duration", _converted(parse_duration), lambda v: f"{v:g}s")
POSITIVE_DURATION = Kind("duration > 0", _positive_duration, lambda v: f"{v:g}s")
SIZE = Kind("size", _converted(parse_size), format_size)
SIZE_OR_AUTO = Kind("size | auto", _size_or_auto, lambda v: "auto" if v is None else format_size(v))
PATH = Kind("path", _path, str)


def setting(default: Any, kind: Kind, doc: str, key: str | None = None) -> Any:
    """A field of a settings dataclass; `key` when the YAML key is not the field's name (a Python keyword)."""
    metadata = {"kind": kind, "doc": doc, "key": key}
    if isinstance(default, list | dict | tuple) and default:
        return dataclasses.field(default_factory=lambda: default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


class HasSettings(Protocol):
    """What a section reads of a config (wrapper/configuration/config.py's Config)."""

    @property
    def settings(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Section(Generic[T]):
    """`optional`: absent means off (`on()` is None); otherwise absent means every default."""

    name: str
    kind: type[T]
    doc: str
    optional: bool = False
    moved: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a key of old -> where it is now
    written: str = ""  # how a value of it is written, for the error when one is given where the section goes

    def fields(self) -> list[tuple[str, dataclasses.Field[Any]]]:
        return [(f.metadata.get("key") or f.name, f) for f in dataclasses.fields(self.kind)]  # type: ignore[arg-type]

    def of(self, config: HasSettings) -> T:
        """The section's settings: as configured, else every default (also for an optional section)."""
        value = config.settings.get(self.name)
        return value if isinstance(value, self.kind) else self.kind()

    def on(self, config: HasSettings) -> T | None:
        """The settings of an optional section, None when the config has no such section (the built-in is off)."""
        value = config.settings.get(self.name)
        return value if isinstance(value, self.kind) else None

    def read(self, r: Reader, node: yaml.Node) -> T:
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
            return self.kind()
        if isinstance(node, yaml.ScalarNode) and self.written:
            r.error(node, f"{self.name} is a section, not a value: write it as {self.name}: {self.written}")
            return self.kind()
        keys = r.mapping(node, self.name, tuple(key for key, _ in self.fields()), self.moved)
        values: dict[str, Any] = {}
        for key, field in self.fields():
            if key in keys:
                kind: Kind = field.metadata["kind"]
                value = kind.read(r, keys[key], f"{self.name}.{key}")
                if value is not None or kind is SIZE_OR_AUTO:
                    values[field.name] = value
        return self.kind(**values)

    def shown(self, config: HasSettings) -> Any:
        """What `check` prints: every key with its value (as written in YAML), or `off`."""
        value = self.on(config) if self.optional else self.of(config)
        if value is None:
            return "off"
        return {key: field.metadata["kind"].show(getattr(value, field.name)) for key, field in self.fields()}

    def table(self) -> str:
        """The table of this section's keys (docs/configuration.md)."""
        rows = [f"| `{self.name}.{key}` | {_cell(field.metadata['kind'].name)} | {_default(field)} | "
                f"{_cell(field.metadata['doc'])} |" for key, field in self.fields()]
        return "\n".join(["| key | type | default | what it does |", "|---|---|---|---|", *rows])


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "—"
    shown = field.metadata["kind"].show(value)
    if isinstance(shown, list | tuple):
        shown = ", ".join(str(item) for item in shown)
    elif isinstance(shown, bool):
        shown = "true" if shown else "false"
    elif isinstance(value, Path):
        shown = str(shown).replace(str(Path.home()), "~", 1)
    return f"`{_cell(str(shown))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def replaced(section: Section[T], value: T | None, changes: Mapping[str, Any]) -> T:
    """`value` (or the defaults) with some fields changed, by field name."""
    return dataclasses.replace(value if value is not None else section.kind(), **changes)  # type: ignore[type-var]
