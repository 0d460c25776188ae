"""Built-in hook actions, bound to the running wrapper."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from wrapper.actions import BuiltinFn
from wrapper.runtime import Runtime


def bind(name: str, runtime: Runtime) -> BuiltinFn:
    from hooks import slots

    table: dict[str, Callable[[Runtime], Awaitable[str | None]]] = {
        "slots.save": slots.save,
        "slots.restore": slots.restore,
    }
    fn = table[name]
    return lambda: fn(runtime)
