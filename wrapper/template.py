"""Jinja2 templates for hook actions: undefined names are errors, shell values are always quoted."""

from __future__ import annotations

import shlex
from typing import Any

import jinja2
import jinja2.sandbox


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


def check_syntax(text: str) -> str | None:
    """A syntax error in a template, or None; used by `check` without a context."""
    try:
        _PLAIN.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return f"template syntax error: {exc.message}"
    return None
