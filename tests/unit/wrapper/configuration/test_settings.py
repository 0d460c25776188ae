"""A built-in's section, declared once: read with file:line errors, shown by `check`, in docs/configuration.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from hooks.conversations.settings import CACHE
from hooks.store.settings import STORE
from tests.helpers import ROOT
from wrapper import built_ins
from wrapper.cli import reference
from wrapper.configuration.config import ConfigError, parse_config
from wrapper.configuration.settings import BOOL, DURATION, Section, choice, setting


@dataclass(frozen=True)
class Toy:
    mode: str = setting("a", choice("a", "b"), "which one")
    patience: float = setting(30.0, DURATION, "how long")
    loud: bool = setting(False, BOOL, "say more", key="verbose")


TOY = Section("toy", Toy, "a toy built-in", optional=True)


def test_a_section_is_read_from_its_declaration() -> None:
    config = parse_config("toy:\n  mode: b\n  patience: 2m\n  verbose: true\n", "t.yaml", (TOY,))
    assert TOY.on(config) == Toy("b", 120.0, True)
    assert TOY.on(parse_config("", "t.yaml", (TOY,))) is None and TOY.of(parse_config("", "t.yaml", (TOY,))) == Toy()
    assert TOY.shown(config) == {"mode": "b", "patience": "120s", "verbose": True}


def test_its_errors_name_file_and_line() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("toy:\n  mode: c\n  patience: soon\n  loud: true\n", "t.yaml", (TOY,))
    message = str(caught.value)
    assert "t.yaml:2: toy.mode must be one of a, b, not 'c'" in message
    assert "t.yaml:3: toy.patience:" in message
    assert "t.yaml:4: unknown key 'loud' in toy" in message


def test_the_configuration_reference_is_the_declarations() -> None:
    page = Path(ROOT) / "docs" / "configuration.md"
    text = page.read_text()
    assert reference.written_into(text) == text, "docs/configuration.md's reference is stale: run `make docs`"
    for section in built_ins.sections():
        assert f"### {section.name}\n" in text and section.table() in text


def test_a_key_that_moved_names_its_new_place() -> None:
    text = ("slots:\n  dir: /tmp/s\n  cache_budget: 1GiB\n  restore_rate: 1MB\n  store: s3://b/p\n"
            "  store_flush: 2s\ncache:\n  entry_max: 2GiB\n  chunk_tokens: 64\n")
    with pytest.raises(ConfigError) as caught:
        built_ins.parse(text, "t.yaml")
    message = str(caught.value)
    assert "t.yaml:3: slots.cache_budget has moved: write it as store.budget" in message
    assert "t.yaml:4: slots.restore_rate has moved: write it as cache.restore_rate" in message
    assert "t.yaml:5: slots.store has moved: write it as store.url" in message
    assert "t.yaml:6: slots.store_flush has moved: write it as store.flush" in message
    assert "t.yaml:8: cache.entry_max has moved: write it as store.entry_max" in message
    assert "t.yaml:9: cache.chunk_tokens has moved: write it as store.chunk_tokens" in message
    config = built_ins.parse("cache:\n  enabled: false\nstore:\n  budget: 1GiB\n", "t.yaml")
    assert CACHE.of(config).enabled is False and STORE.of(config).budget == 1 << 30
