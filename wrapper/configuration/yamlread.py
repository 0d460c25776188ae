"""Reading YAML with every key's line kept, so that each error names file:line."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import yaml


def suggest(name: str, known: tuple[str, ...]) -> str:
    hint = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(known)})"


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}

class Reader:
    """Walks the YAML node tree so that every key and value keeps its line for error messages."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self._constructor = yaml.SafeLoader("")

    def where(self, node: yaml.Node) -> str:
        return f"{self.path}:{node.start_mark.line + 1}"

    def error(self, node: yaml.Node, message: str) -> None:
        self.errors.append(f"{self.where(node)}: {message}")

    def warn(self, node: yaml.Node, message: str) -> None:
        self.warnings.append(f"{self.where(node)}: {message}")

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...],
                moved: Mapping[str, str] | None = None) -> dict[str, yaml.Node]:
        """The keys of a mapping; an unknown key is an error (with the closest known one), a key in `moved`
        one that names where it is now."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{what} must be a mapping")
            return {}
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                self.error(key_node, f"{what}: keys must be plain names")
            elif moved and key in moved:
                self.error(key_node, f"{what}.{key} has moved: write it as {moved[key]}")
            elif key not in allowed:
                self.error(key_node, f"unknown key {key!r} in {what}{suggest(key, allowed)}")
            elif key in out:
                self.error(key_node, f"{what}: key {key!r} given twice")
            else:
                out[key] = value_node
        return out

    def value(self, node: yaml.Node) -> Any:
        return self._constructor.construct_object(node, deep=True)

    def scalar(self, node: yaml.Node, what: str, kinds: tuple[type, ...]) -> Any:
        value = self.value(node)
        if not isinstance(node, yaml.ScalarNode) or not isinstance(value, kinds) or (
            isinstance(value, bool) and bool not in kinds
        ):
            names = " or ".join(_KIND_NAMES.get(k, f"a {k.__name__}") for k in kinds)
            self.error(node, f"{what} must be {names}, not {value!r}")
            return None
        return value

    def converted(self, node: yaml.Node, what: str, convert: Callable[[Any], Any]) -> Any:
        try:
            return convert(self.value(node))
        except (ValueError, TypeError) as exc:
            self.error(node, f"{what}: {exc}")
            return None

    def string_list(self, node: yaml.Node, what: str) -> tuple[str, ...]:
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            self.error(node, f"{what} must be a non-empty list of strings")
            return ()
        items = [self.scalar(item, f"{what} item", (str, int, float)) for item in node.value]
        return tuple(str(item) for item in items if item is not None)
