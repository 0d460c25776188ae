"""A llama-server upgrade keeps the conversations: saved under an older build (llama.cpp/OLD_VERSION, state
version 2), they continue under the pinned one (version 4) by conversion; saved under the pinned one and opened
by the older build, the start never fails and the slots are prefilled in the background."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import models
from tests.helpers import Wrapper, chat, http, running, wait_for

CONFIG = """
slots: {{dir: {dir}}}
priority: {{lane: false}}  # one slot per -np on both builds: these tests count what leaves it and what comes back
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "


@pytest.fixture(scope="module")
def old_bin() -> str:
    found = models.old_llama_server()
    if found is None:
        pytest.skip("the older llama-server is not built: `make old-server` builds it (5-20 minutes), or set "
                    "LLAMA_SERVER_OLD; .ci/run does")
    return found



def first_word(answer: dict[str, Any]) -> str:
    text: str = answer["choices"][0]["message"]["content"]
    return text.split()[0] if text.split() else text


def conversation(name: str, repeat: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Remember the story of {name}. " + STORY * repeat}]


def next_turn(history: list[dict[str, Any]], answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [*history, answer["choices"][0]["message"], {"role": "user", "content": "Who kept the ledger?"}]


@pytest.mark.parametrize("cache", ["f16", "q8_0"])
def test_conversations_saved_by_an_older_build_continue_after_the_upgrade(
        tmp_path: Path, old_bin: str, server_bin: str, demo_path: str, cache: str) -> None:
    """A quantized cache is rotated by both builds, which only the newer one writes down: the conversion adds
    the rotation the older one applied, and the next turn answers as a fresh prefill of it does."""
    config = CONFIG.format(dir=tmp_path / "slots")
    first, second = conversation("the north", 40), conversation("the south", 30)
    types = ["-ctk", cache, "-ctv", cache]
    with running(tmp_path, [old_bin, "-m", demo_path, "-c", "4096", "-np", "1", *types], config) as old:
        assert "b9095" in str(json.loads(http("GET", f"{old.url}/props")[2]).get("build_info"))
        one = chat(old.url, first)
        two = chat(old.url, second)  # the first leaves the slot: the conversation cache keeps it
        assert old.stop() == 0
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "1", *types], config) as new:
        converted = new.events("slots.converted")
        assert converted and "state version 2" in converted[0]["from"], new.events("slots.restore_skipped")
        again = chat(new.url, next_turn(second, two))  # the slot file, converted at the start
        assert again["timings"]["cache_n"] >= 0.9 * two["timings"]["prompt_n"], again["timings"]
        back = chat(new.url, next_turn(first, one))  # a cache entry, converted when its turn came
        assert back["timings"]["cache_n"] >= 0.9 * one["timings"]["prompt_n"], back["timings"]
        assert len(new.events("slots.converted")) >= 2
        fresh = chat(new.url, next_turn(first, one), cache_prompt=False)  # the same turn prefilled from nothing
        assert fresh["timings"]["prompt_n"] > 0.9 * one["timings"]["prompt_n"]
        assert first_word(back) == first_word(fresh), (back["choices"], fresh["choices"])


def test_a_newer_builds_slots_under_an_older_build_are_prefilled_not_a_failed_start(
        tmp_path: Path, old_bin: str, server_bin: str, demo_path: str) -> None:
    config = CONFIG.format(dir=tmp_path / "slots")
    story = conversation("the west", 40)
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"], config) as new:
        answer = chat(new.url, story)
        assert new.stop() == 0
    old = Wrapper(tmp_path, [old_bin, "-m", demo_path, "-c", "4096", "-np", "1"], config)
    try:
        old.wait_ready(120)  # the start does not wait for the warm-up
        wait_for(lambda: old.events("slots.warmed"), 120, "the background warm-up")
        warmed = old.events("slots.warmed")[0]
        assert warmed["warmed"] == 1, warmed
        status = old.status()
        assert any(r.get("outcome") == "prefilled" for r in status["slots"]["restore"]), status["slots"]
        again = chat(old.url, next_turn(story, answer))
        assert again["timings"]["cache_n"] >= 0.9 * answer["timings"]["prompt_n"], again["timings"]
    finally:
        old.kill()
