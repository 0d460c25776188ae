"""A reload request turned into the next llama-server argv, or refused with every reason at once."""

from __future__ import annotations

import pytest

from wrapper.configuration.reload_plan import ReloadRefused, plan

ARITY = {"-c": True, "--ctx-size": True, "-ctk": True, "--cache-type-k": True, "-ctv": True, "--cache-type-v": True,
         "--swa-full": False, "-kvu": False, "--kv-unified": False, "-no-kvu": False, "--no-kv-unified": False,
         "-md": True, "--model-draft": True, "--spec-draft-n-max": True, "--spec-type": True, "-mm": True,
         "--mmproj": True, "--no-mmproj-offload": False, "-ngl": True, "--metrics": False, "-fa": True,
         "--flash-attn": True, "--port": True}
ARGV = ["llama-server", "-m", "m.gguf", "-c", "4096", "-md", "draft.gguf", "--spec-draft-n-max", "8",
        "--mmproj", "p.gguf", "--swa-full"]


def test_fields_become_argv_edits() -> None:
    result = plan(ARGV, {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0", "swa_full": False,
                         "kv_unified": True, "spec": {"types": ["none"]}, "mmproj": {"path": ""}}, ARITY)
    assert result.argv == ["llama-server", "-m", "m.gguf", "--ctx-size", "16384", "--cache-type-k", "q8_0",
                           "--cache-type-v", "q8_0", "--kv-unified"]
    assert result.settings == {"slots": {"swa_full": "never"}}
    assert {"-c 4096 -> 16384", "-md removed", "--swa-full off"} <= set(result.changes)


def test_free_edits_and_switches() -> None:
    result = plan(ARGV, {"args": {"set": {"-ngl": 99, "--metrics": True, "--swa-full": False},
                                  "remove": ["--mmproj"]}}, ARITY)
    assert result.argv[-3:] == ["-ngl", "99", "--metrics"] and "--swa-full" not in result.argv
    assert "--mmproj" not in result.argv and "p.gguf" not in result.argv


def test_everything_wrong_is_said_at_once() -> None:
    with pytest.raises(ReloadRefused) as refused:
        plan(ARGV, {"n_ctx": 0, "cache_type_k": "q3", "bogus": 1, "spec": {"types": ["ngram"]},
                    "args": {"set": {"--port": "1", "--no-such": "x", "--metrics": "yes"}}}, ARITY)
    message = str(refused.value)
    for part in ("unknown field(s) bogus", "n_ctx must be a positive integer", "cache_type_k must be one of",
                 'only {"types": ["none"]}', "--port cannot be changed", "does not know --no-such",
                 "--metrics is a switch"):
        assert part in message, part
    assert refused.value.status == 400


def test_nothing_to_change_and_quantized_v_without_flash_attention_are_refused() -> None:
    with pytest.raises(ReloadRefused, match="nothing to change: n_ctx already in force"):
        plan(ARGV, {"n_ctx": 4096}, ARITY)
    with pytest.raises(ReloadRefused, match="nothing to change: give at least one of n_ctx"):
        plan(ARGV, {}, ARITY)
    with pytest.raises(ReloadRefused, match="needs flash attention"):
        plan([*ARGV, "-fa", "off"], {"cache_type_v": "q8_0"}, ARITY)


def test_without_help_flags_are_taken_as_given() -> None:
    result = plan(["llama-server", "-m", "m.gguf"], {"args": {"set": {"--anything": "1"}}}, None)
    assert result.argv[-2:] == ["--anything", "1"]


def test_a_builtins_reload_says_what_changed_flag_by_flag() -> None:
    from wrapper.life.reloader import _argv_changes

    old = ["llama-server", "-m", "m.gguf", "--port", "1", "-c", "2048", "-ngl", "-1", "--swa-full", "-lv", "4"]
    new = ["llama-server", "-m", "m.gguf", "--port", "2", "-c", "3584", "-ngl", "-1", "-ctk", "q8_0", "-lv", "4"]
    assert _argv_changes(old, new) == ["-c 2048 -> 3584", "-ctk q8_0 added", "--swa-full removed"]
    assert _argv_changes(old, [*old[:4], "9", *old[5:]]) == []  # only the private port differs
