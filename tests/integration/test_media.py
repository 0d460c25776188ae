"""Images against the real server with a small real projector (tests/media.py makes it): the projector on
demand (loaded by the first image, every conversation kept, dropped when idle, loaded again), and the
wrapper's 400 for media when there is no projector at all."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests import media
from tests.helpers import Wrapper, http, running, wait_for

SMOLLM2_WIDTH = 576  # SmolLM2 135M's embedding_length: the projector's output width
CONFIG = """
slots: {{dir: {dir}}}
media: {{projector: on_demand, idle: {idle}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. " * 12


@pytest.fixture(scope="module")
def projector(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return media.make_projector(tmp_path_factory.mktemp("mmproj") / "mmproj-test.gguf", SMOLLM2_WIDTH)


def chat(url: str, messages: list[dict[str, Any]], **extra: Any) -> tuple[int, dict[str, Any]]:
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": messages, "max_tokens": 6, "temperature": 0, **extra}, timeout=300)
    return status, json.loads(raw)


def reused(answer: dict[str, Any], before: int) -> float:
    return float(answer["timings"]["cache_n"]) / before


def argv_of(wrapper: Wrapper) -> list[str]:
    found: list[str] = wrapper.status()["server"]["argv"]
    return found


def test_the_first_image_loads_the_projector_every_conversation_is_kept_and_idle_drops_it(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    argv = [server_bin, "-m", demo_path, "--mmproj", str(projector), "-c", "8192", "-np", "2"]
    with running(tmp_path, argv, CONFIG.format(dir=tmp_path / "slots", idle="4s")) as wrapper:
        assert "--mmproj" not in argv_of(wrapper) and wrapper.status()["media"]["loaded"] is False
        props = json.loads(http("GET", f"{wrapper.url}/props")[2])
        assert props["modalities"]["vision"] is True  # a front-end offers its image button
        models = json.loads(http("GET", f"{wrapper.url}/v1/models")[2])
        assert models["data"][0]["architecture"]["input_modalities"] == ["text", "image", "video"]
        assert "multimodal" in models["models"][0]["capabilities"]  # as llama-server says them with it
        marker_before = props["media_marker"]

        text = [{"role": "user", "content": "Remember this story. " + STORY}]
        status, first = chat(wrapper.url, text)
        assert status == 200
        text_so_far = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        text += [first["choices"][0]["message"], {"role": "user", "content": "Who wrote in the ledger?"}]

        image = [media.image_message("What is in this picture? " + STORY[:200], media.png(seed=1))]
        status, seen = chat(wrapper.url, image)
        assert status == 200, seen
        assert "--mmproj" in argv_of(wrapper) and wrapper.status()["media"]["loaded"] is True
        (loaded,) = wrapper.events("media.projector_loaded")
        assert loaded["kind"] == "image" and loaded["wait_s"] > 0
        image_so_far = seen["usage"]["prompt_tokens"] + seen["usage"]["completion_tokens"]
        image += [seen["choices"][0]["message"], {"role": "user", "content": "And the colours?"}]

        status, answer = chat(wrapper.url, text)
        assert status == 200 and reused(answer, text_so_far) >= 0.95, answer["timings"]
        status, answer = chat(wrapper.url, image)
        assert status == 200 and reused(answer, image_so_far) >= 0.90, answer["timings"]

        # a /completion prompt written with the marker read before the projector was loaded still works
        prompt = media.completion_prompt(f"Describe {marker_before} briefly.", [media.png(seed=2)], marker_before)
        status, _, raw = http("POST", f"{wrapper.url}/completion", {"prompt": prompt, "n_predict": 4}, timeout=300)
        assert status == 200, raw[:300]
        assert wrapper.events("media.marker_replaced")

        dropped = wait_for(lambda: wrapper.events("media.projector_dropped"), 60, "the idle projector dropped")
        assert dropped[0]["idle_s"] >= 4
        wait_for(lambda: wrapper.status()["state"] == "ready", 60, "the reload that dropped it to end")
        assert "--mmproj" not in argv_of(wrapper)
        skipped = [e for e in wrapper.events("slots.restore_skipped") if "media" in e["reason"]]
        assert skipped, "the slot that holds the image was not restored into a server without the projector"

        status, answer = chat(wrapper.url, image)  # the image conversation comes back: loaded again first
        assert status == 200 and wrapper.status()["media"]["loads"] == 2
        assert "--mmproj" in argv_of(wrapper)
        assert reused(answer, image_so_far) >= 0.90, answer["timings"]
        assert wrapper.stop() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_without_any_projector_a_media_request_is_the_wrappers_400(
        tmp_path: Path, server_bin: str, demo_path: str, stream: bool) -> None:
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "2048", "-np", "1"]) as wrapper:
        status, answer = chat(wrapper.url, [media.image_message("What is this?", media.png())], stream=stream)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert "no projector" in answer["error"]["message"] and "--mmproj" in answer["error"]["message"]
        status, _, raw = http("POST", f"{wrapper.url}/completion", {"prompt": media.completion_prompt(
            "What is <__media__>?", [media.png()], "<__media__>"), "n_predict": 4})
        assert status == 400 and "no projector" in json.loads(raw)["error"]["message"]
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Just text."}], "max_tokens": 4, "stream": stream})
        assert status == 200 and (b"data: " in raw) == stream
        assert len(wrapper.events("media.refused")) == 2


def test_images_arriving_together_load_the_projector_once_and_all_are_answered(
        tmp_path: Path, server_bin: str, demo_path: str, projector: Path) -> None:
    argv = [server_bin, "-m", demo_path, "--mmproj", str(projector), "-c", "4096", "-np", "2"]
    with running(tmp_path, argv, CONFIG.format(dir=tmp_path / "slots", idle="15m")) as wrapper:
        answers: list[int] = []

        def ask(seed: int, stream: bool) -> None:
            body = media.chat_body(f"Picture {seed}?", media.png(seed=seed), stream=stream)
            answers.append(http("POST", f"{wrapper.url}/v1/chat/completions", body, timeout=300)[0])

        clients = [threading.Thread(target=ask, args=(seed, seed % 2 == 0)) for seed in range(4)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(300)
        assert answers == [200] * 4
        assert wrapper.status()["media"]["loads"] == 1 and len(wrapper.events("media.projector_loaded")) == 1
        assert wrapper.stop() == 0
