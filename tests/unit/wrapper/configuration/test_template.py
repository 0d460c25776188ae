from __future__ import annotations

import subprocess

import pytest

from wrapper.configuration.config import ConfigError, parse_config
from wrapper.configuration.template import TemplateError, evaluate, render, render_data, render_shell


def test_shell_values_are_quoted_and_cannot_inject(tmp_path: object) -> None:
    hostile = "x'; touch /tmp/pwned-by-template; echo '"
    command = render_shell("printf '%s' {{ value }}", {"value": hostile})
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True).stdout
    assert out == hostile


def test_plain_values_are_not_quoted() -> None:
    assert render("{{ a }}/{{ b }}", {"a": "http://h:1", "b": "x y"}) == "http://h:1/x y"


def test_undefined_names_are_errors() -> None:
    with pytest.raises(TemplateError, match="'nope' is undefined"):
        render("{{ nope }}", {})
    with pytest.raises(TemplateError):
        render("{{ server.nope }}", {"server": {}})


def test_render_data_walks_json() -> None:
    data = {"a": ["{{ x }}", 1, {"{{ x }}": True}]}
    assert render_data(data, {"x": "y"}) == {"a": ["y", 1, {"y": True}]}


def test_when_expressions() -> None:
    assert evaluate('result == "success"', {"result": "success"})
    assert not evaluate("exit_code and exit_code > 0", {"exit_code": None})
    with pytest.raises(TemplateError):
        evaluate("missing > 1", {})


def test_templates_are_sandboxed() -> None:
    with pytest.raises(TemplateError):
        render("{{ ''.__class__.__mro__ }}", {})


def test_a_name_a_hook_does_not_set_is_a_config_error() -> None:
    """`{{ reload.n_ctx }}` in on_startup passed `check`, then failed the start ('None' has no attribute)."""
    with pytest.raises(ConfigError, match=r"hooks.on_startup\[0\]: 'reload' is set only in on_reload hooks"):
        parse_config("hooks:\n  on_startup:\n    - shell: echo {{ reload.n_ctx }}\n", "t.yaml")
    assert parse_config("hooks:\n  on_reload:\n    - shell: echo {{ reload.n_ctx }}\n", "t.yaml").hooks["on_reload"]
