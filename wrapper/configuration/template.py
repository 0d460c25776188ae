"""Jinja2 templates for hook actions: undefined names are errors, shell values are always quoted."""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Iterable
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from wrapper.configuration.hook_context import NAMES, ONLY_IN


class TemplateError(Exception):
    """A template that cannot be rendered with the hook's context."""


def _environment(finalize: Any = None) -> jinja2.Environment:
    # Sandboxed: templates come from the operator's file, but there is no reason to let them reach internals.
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True, finalize=finalize
    )


_PLAIN = _environment()
# Every `{{ }}` value in a shell action is quoted on the way in: a value can never become shell syntax.
_SHELL = _environment(finalize=lambda value: shlex.quote(str(value)))


def render(text: str, context: dict[str, Any]) -> str:
    return _render(_PLAIN, text, context)


def render_shell(text: str, context: dict[str, Any]) -> str:
    return _render(_SHELL, text, context)


def render_data(value: Any, context: dict[str, Any]) -> Any:
    """Render every string inside a JSON-like value (dicts, lists, scalars)."""
    if isinstance(value, str):
        return render(value, context)
    if isinstance(value, dict):
        return {render(str(k), context): render_data(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [render_data(item, context) for item in value]
    return value


def evaluate(expression: str, context: dict[str, Any]) -> bool:
    """The truth of a `when:` expression."""
    try:
        return bool(_PLAIN.compile_expression(expression, undefined_to_none=False)(**context))
    except jinja2.TemplateError as exc:
        raise TemplateError(f"when {expression!r}: {exc}") from exc


def _render(env: jinja2.Environment, text: str, context: dict[str, Any]) -> str:
    try:
        return env.from_string(text).render(context)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"{text!r}: {exc}") from exc


CONTEXT = NAMES  # the names a hook's template may use, and the keys of those whose shape is fixed


def problems(text: str, expression: bool = False, event: str | None = None) -> list[str]:
    """What would make `text` fail to render: a syntax error, an unknown name, an unknown key of a known name,
    a name the hook `event` does not set.

    Checked when the config is loaded, so a typo is a config error with file:line, not a failed stop hook.
    """
    source = "{{ (" + text + ") }}" if expression else text
    try:
        tree = _PLAIN.parse(source)
    except jinja2.TemplateSyntaxError as exc:
        return [f"template syntax error in {text!r}: {exc.message}"]
    found = []
    for name in sorted(jinja2.meta.find_undeclared_variables(tree) - set(_PLAIN.globals)):
        if name not in CONTEXT:
            found.append(f"unknown name {name!r} in {text!r}{_hint(name, CONTEXT)}")
        elif event is not None and event not in ONLY_IN.get(name, (event,)):
            found.append(f"{name!r} is set only in {', '.join(ONLY_IN[name])} hooks, not in {event} ({text!r})")
    for node in tree.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)):
        owner, key = getattr(node, "node", None), _key(node)
        if not isinstance(owner, jinja2.nodes.Name) or key is None:
            continue
        known = CONTEXT.get(owner.name)
        if known is not None and key not in known:
            found.append(f"{owner.name} has no {key!r} in {text!r}{_hint(key, known)}")
    return found


def _key(node: jinja2.nodes.Node) -> str | None:
    if isinstance(node, jinja2.nodes.Getattr):
        return str(node.attr)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return str(node.arg.value)
    return None


def _hint(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"


def quoted_templates(shell: str) -> list[str]:
    """The `{{ }}` of a shell command that stand inside quotes: the value is quoted already, and the quotes
    around it turn that quoting off (a value with `$(...)` or backticks would then run inside "...")."""
    found, quote, index = [], "", 0
    while index < len(shell):
        char = shell[index]
        if char == "\\" and quote != "'":
            index += 2
            continue
        if shell.startswith("{{", index) and quote:
            end = shell.find("}}", index)
            found.append(shell[index:end + 2 if end >= 0 else len(shell)])
        if char in "'\"" and (not quote or quote == char):
            quote = "" if quote else char
        index += 1
    return found
