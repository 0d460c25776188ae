"""The supervisor against a tiny real child: a restore that kills the server never fails the start, nor the
request it was for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hooks.store import layout
from hooks.store.folder import DirectoryStore, part_name
from tests.helpers import Wrapper, child_argv, http, running, wait_for
from tests.slotfiles import slot_bytes
from wrapper.launching.model import fingerprint

CONFIG = """
slots: {{dir: {dir}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
"""


def test_a_file_that_kills_the_server_is_set_aside_and_the_start_goes_on(tmp_path: Path) -> None:
    """A file that passes every check and still makes llama-server abort (GGML_ASSERT in its state read):
    the file goes to set-aside/ with its reason, the server starts again without it, the wrapper comes up."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    folder = tmp_path / "slots" / fingerprint(str(model))
    folder.mkdir(parents=True)
    written = folder / "slot0.bin.0.tmp"
    written.write_bytes(slot_bytes([1, 2, 3]))
    record = {"model": {"id": fingerprint(str(model)), "name": "m", "path": str(model)}, "tokens": 3,
              "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "on", "kv_streams": 1, "build": "b0"}
    layout.commit(folder, 0, written, record)
    argv = child_argv("--die-on-restore", "-m", str(model), "--slot-save-path", str(folder))
    with running(tmp_path, argv, CONFIG.format(dir=tmp_path / "slots"), timeout=60) as wrapper:
        aside = folder / layout.SET_ASIDE
        assert len(list(aside.glob("*slot0-*.bin"))) == 1 and len(list(aside.glob("*slot0.json"))) == 1
        assert "llama-server died restoring it" in next(aside.glob("*.reason.txt")).read_text()
        assert not (folder / "slot0.json").exists()
        assert [(e["on"], e["attempt"]) for e in wrapper.events("wrapper.restarting_server")] == [("restore", 1)]
        assert len(wrapper.events("child.spawned")) == 2
        restores = [e for e in wrapper.events("hook.run") if e["action"] == "slots.restore"]
        assert [r["outcome"] for r in restores] == ["failed", "ok"], restores
        assert wrapper.stop() == 0


def test_a_conversation_that_kills_the_server_before_a_request_is_set_aside_and_the_request_answered(
        tmp_path: Path) -> None:
    """The conversation cache restores a kept conversation before a request and llama-server aborts in it: the
    entry goes to set-aside/, the loss is reported to the one watch and the server started again as after a crash
    (requests held, the one restart budget spent), the request is answered by it, and the wrapper serves on."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + np.random.default_rng(6).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes())
    folder = tmp_path / "slots" / fingerprint(str(model))
    folder.mkdir(parents=True)
    store = DirectoryStore(folder)
    prompt = "Tell me everything about lighthouses. " * 12  # one token per byte for this child
    kept = list(prompt.encode())[:400]
    part = folder / part_name("test")
    part.write_bytes(slot_bytes(kept))
    store.commit(part, kept, {"model": {"id": fingerprint(str(model)), "name": "m", "path": str(model)},
                              "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "on", "kv_streams": 1,
                              "build": "b0"})
    argv = child_argv("--die-on-restore", "-m", str(model), "--slot-save-path", str(folder))
    with running(tmp_path, argv, CONFIG.format(dir=tmp_path / "slots"), timeout=60) as wrapper:
        assert len(wrapper.events("child.spawned")) == 1
        status, _, answer = http("POST", f"{wrapper.url}/completion", {"prompt": prompt, "n_predict": 4}, timeout=60)
        assert (status, json.loads(answer)["path"]) == (200, "/completion")
        (restarted,) = wrapper.events("wrapper.restarting_server")
        assert restarted["on"] == "restore" and "set aside" in restarted["why"]
        (lost,) = wrapper.events("wrapper.server_lost")
        assert lost["reason"] == "restore" and wrapper.status()["restarts"]["count"] == 1
        states = [e["new"] for e in wrapper.events("state.changed")]
        assert "restarting" in states and "reloading" not in states
        assert len(wrapper.events("child.spawned")) == 2 and wrapper.events("conversations.server_lost")
        aside = folder / layout.SET_ASIDE
        assert len(list(aside.glob("*conv-*.bin"))) == 1
        assert "llama-server died restoring it" in next(aside.glob("*.reason.txt")).read_text()
        assert store.find(kept) is None
        status, _, _ = http("POST", f"{wrapper.url}/completion", {"prompt": prompt, "n_predict": 4}, timeout=60)
        assert status == 200 and len(wrapper.events("child.spawned")) == 2  # nothing left to kill it
        assert wrapper.health() and wrapper.status()["state"] == "ready"
        assert wrapper.stop() == 0


def test_long_work_says_how_far_it_is_in_status_and_the_log(tmp_path: Path) -> None:
    config = "hooks:\n  on_startup: [{shell: sleep 5, timeout: 30s}]\n"
    with Wrapper(tmp_path, child_argv(), config) as wrapper:
        progress = wait_for(lambda: (wrapper.status() if wrapper.health() else {}).get("progress"), 30,
                            "the start's progress in status")
        assert progress["phase"] in ("starting: loading the model", "starting: on_startup (restoring slots)")
        wrapper.wait_ready(30)
        logged = [e for e in wrapper.events("progress") if e["phase"] == "starting: on_startup (restoring slots)"]
        assert len(logged) >= 2 and logged[-1]["for_s"] >= 4  # every 2 s while it lasts
        assert wrapper.status()["progress"] is None


@pytest.mark.parametrize(("config", "budget", "level"), [("", 10.0, "info"),
                                                          ("server: {stop_budget: 1s}\n", 1.0, "warning")])
def test_a_stop_close_to_the_budget_it_is_given_is_a_warning(tmp_path: Path, config: str, budget: float,
                                                              level: str) -> None:
    """llama-swap does not tell its `cmd` the grace a stop has (`unloadTimeout`): `server.stop_budget` does."""
    with running(tmp_path, child_argv("--term-delay", "1"), config, timeout=30) as wrapper:
        assert wrapper.stop() == 0
        (stopped,) = wrapper.events("wrapper.stopped")
        assert stopped["stop_s"] >= 1 and stopped["budget_hint_s"] == budget and stopped["level"] == level, stopped
