"""The media built-in with no process: which requests carry media (a table over every API llama-server takes
media on), the argv with the projector on demand, and what clients are told while it is not loaded."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

import pytest

from hooks.asks import MemoryMove, Projector, asking
from hooks.media.detect import media_in
from hooks.media.fit import fit
from hooks.media.report import shown
from hooks.media.state import STATE
from wrapper import built_ins
from wrapper.answers.proxy import json_object
from wrapper.configuration.config import Listen
from wrapper.kept import Kept
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.server.generation import Generation

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
TABLE: list[tuple[str, Any, str | None]] = [
    ("text chat", {"messages": [{"role": "user", "content": "hi"}]}, None),
    ("text parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, None),
    ("an OpenAI image part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, IMAGE]}]},
     "image"),
    ("an image in an earlier turn", {"messages": [{"role": "user", "content": [IMAGE]},
                                                  {"role": "assistant", "content": "a cat"},
                                                  {"role": "user", "content": "and now?"}]}, "image"),
    ("OpenAI audio", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, "audio"),
    ("a video url", {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "video"),
    ("Responses input_image", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "?"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
     "image"),
    ("Anthropic image block", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]}, "image"),
    ("a bare type image elsewhere", {"response_format": {"type": "image"}}, None),
    ("an empty image_url part still needs the projector", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}, "image"),
    ("/completion multimodal_data", {"prompt": {"prompt_string": "<__media__> what?", "multimodal_data": ["AA"]}},
     "image"),
    ("empty multimodal_data", {"prompt": {"prompt_string": "hi", "multimodal_data": []}}, None),
    ("a text that names image_url", {"prompt": "type image_url please"}, None),
    ("not an object", ["image_url"], None),
]


@pytest.mark.parametrize(("case", "payload", "kind"), TABLE, ids=[row[0] for row in TABLE])
def test_which_requests_carry_media(case: str, payload: Any, kind: str | None) -> None:
    assert media_in(payload) == kind, case


def test_a_body_nested_past_any_chat_request_is_not_walked_forever() -> None:
    deep: Any = IMAGE
    for _ in range(10_000):
        deep = [deep]
    assert media_in(deep) is None


def _launch(argv: list[str]) -> Launch:
    return Launch(argv=argv, port=1, listen=Listen("127.0.0.1", 8080), model=Model(None, "m", "m"), env={})


ARGV = ["llama-server", "-m", "m.gguf", "--mmproj", "p.gguf", "-c", "4096"]


def test_on_demand_the_projector_is_in_the_argv_only_while_wanted() -> None:
    config, shared = built_ins.parse("media: {projector: on_demand}\n"), Kept()
    left_out = fit(ARGV, _launch(ARGV), config, shared, {})
    assert left_out.argv == ["llama-server", "-m", "m.gguf", "-c", "4096"] and left_out.fitted is False
    assert "--mmproj p.gguf left out" in left_out.notes[0]["change"]
    loaded = fit(ARGV, _launch(ARGV), config, shared, asking(Projector(wanted=True)))
    assert loaded.argv == ARGV and shared.get(STATE).wanted
    assert fit(ARGV, _launch(ARGV), config, shared, {}).argv == ARGV  # another reload keeps it while wanted
    assert fit(ARGV, _launch(ARGV), config, shared, asking(Projector(wanted=False))).argv == left_out.argv
    fit(ARGV, _launch(ARGV), config, shared, asking(Projector(wanted=True)))
    shared.get(STATE).in_flight = 1  # a request with media in flight keeps it through a memory move
    assert fit(ARGV, _launch(ARGV), config, shared, asking(MemoryMove())).argv == ARGV
    shared.get(STATE).in_flight = 0  # unused: the first thing a memory move gives up
    assert fit(ARGV, _launch(ARGV), config, shared, asking(MemoryMove())).argv == left_out.argv
    assert shared.get(STATE).decisions[-1]["change"] == "given up"
    always = built_ins.parse("")
    assert fit(ARGV, _launch(ARGV), always, Kept(), {}).argv == ARGV


def _generation(config_text: str, argv: list[str]) -> Generation:
    config = built_ins.parse(config_text)
    config = replace(config, argv=tuple(argv))
    return cast(Generation, type("G", (), {"config": config, "launch": _launch(argv), "shared": Kept(),
                                           "state": Kept()})())


def test_while_it_waits_clients_are_told_the_model_sees_images() -> None:
    waiting = _generation("media: {projector: on_demand}\n", ARGV)
    waiting.launch = _launch(["llama-server", "-m", "m.gguf"])  # started without it
    props = shown(waiting, "/props", {"modalities": {"vision": False, "audio": False}, "total_slots": 1})
    assert props == {"modalities": {"vision": True, "video": True, "audio": False}, "total_slots": 1}
    models = shown(waiting, "/v1/models", {  # llama-server's answer without the projector
        "models": [{"name": "m", "capabilities": ["completion"]}],
        "data": [{"id": "m", "architecture": {"input_modalities": ["text"], "tokenizer": "x"}}]})
    assert models["data"][0]["architecture"] == {"input_modalities": ["text", "image", "video"], "tokenizer": "x"}
    assert models["models"][0]["capabilities"] == ["completion", "multimodal"]
    always = _generation("", ["llama-server", "-m", "m.gguf"])
    assert shown(always, "/props", {"modalities": {"vision": False}}) == {"modalities": {"vision": False}}


def test_what_a_server_with_the_projector_said_is_what_is_promised_later() -> None:
    with_it = _generation("media: {projector: on_demand}\n", ARGV)
    shown(with_it, "/props", {"modalities": {"vision": True, "audio": True}})  # loaded: learnt, passed on
    without = cast(Generation, type("G", (), {"config": with_it.config, "shared": with_it.shared,
                                              "launch": _launch(["llama-server", "-m", "m.gguf"])})())
    assert shown(without, "/props", {"modalities": {}})["modalities"] == {"vision": True, "audio": True}


def test_check_warns_of_a_projector_on_demand_with_nothing_to_load() -> None:
    config = replace(built_ins.parse("media: {projector: on_demand}\n"), argv=("llama-server", "-m", "m.gguf"))
    (warning,) = built_ins.warnings(config)
    assert "names no --mmproj" in warning and "add --mmproj FILE" in warning
    assert built_ins.warnings(replace(config, argv=tuple(ARGV))) == []
    assert built_ins.warnings(built_ins.parse("media: {projector: on_demand}\n")) == []  # argv after --


def test_a_body_nested_deeper_than_the_parser_goes_is_passed_on() -> None:
    assert json_object(b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}") is None
