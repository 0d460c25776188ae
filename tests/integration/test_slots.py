"""Slot persistence against the real llama-server: the prefill really is saved across restarts."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

from hooks import kvfile
from hooks.store import layout
from tests.helpers import Wrapper, chat, http, running, wait_for
from wrapper.launching.model import fingerprint

PERSIST = """
slots:
  dir: {dir}
  swa_full: {swa_full}
hooks:
  on_startup:
    - builtin: slots.restore
  on_will_stop:
    - builtin: slots.save
"""
WHOLE = "store: {chunk_tokens: 0}\n"  # the tests that damage a state file in place keep it as llama-server wrote it
# (chunked entries' damage: tests/unit/store/test_chunked_folder.py and test_conversations.py)
SAVE_ONLY = """
slots: {{dir: {dir}}}
hooks:
  on_will_stop:
    - builtin: slots.save
"""
STORY = ("The lighthouse keeper counted the ships that passed the northern cape each night, writing their names "
         "in a ledger bound with blue thread. ")


def prompt(words: int, seed: str) -> str:
    text = seed + " "
    while len(text.split()) < words:
        text += STORY
    return text


def complete(url: str, text: str, slot: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": text, "n_predict": 8, "temperature": 0, "cache_prompt": True}
    if slot is not None:
        body["id_slot"] = slot
    status, _, raw = http("POST", f"{url}/completion", body, timeout=300)
    assert status == 200, raw
    result: dict[str, Any] = json.loads(raw)
    return result


def model_dir(slots_dir: Path) -> Path:
    folders = [p for p in slots_dir.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def sidecar_file(folder: Path, slot: int = 0) -> Path:
    """The sidecar of the entry this host's note says slot `slot` held."""
    (saved,) = [saved for saved in layout.saved_slots(folder) if saved.slot == slot]
    assert saved.key is not None and saved.sidecar.exists(), saved
    return saved.sidecar


def kv_file(folder: Path, slot: int = 0) -> Path:
    """The KV file of the entry slot `slot` held."""
    return folder / str(json.loads(sidecar_file(folder, slot).read_text())["file"])


def reseal(folder: Path, slot: int = 0) -> None:
    """Make the sidecar describe the KV file as it is now: a file the server itself wrote that way."""
    path = sidecar_file(folder, slot)
    sidecar = json.loads(path.read_text())
    kv = folder / sidecar["file"]
    sidecar.update(bytes=kv.stat().st_size, fingerprint=fingerprint(str(kv)))
    path.write_text(json.dumps(sidecar))


def restore_report(wrapper: Wrapper) -> list[dict[str, Any]]:
    report: list[dict[str, Any]] = wrapper.status()["slots"]["restore"]
    return report


@pytest.mark.parametrize("model", ["gemma", "tiny"])
def test_next_turn_after_a_restart_comes_from_the_cache(
        tmp_path: Path, slots_dir: Path, server_bin: str, gemma_path: str, tiny_path: str, model: str) -> None:
    path = gemma_path if model == "gemma" else tiny_path
    argv = [server_bin, "-m", path, "-c", "4096", "-np", "1"]
    config = PERSIST.format(dir=slots_dir, swa_full="auto")
    first = prompt(900, "Chapter one.")
    with running(tmp_path, argv, config) as wrapper:
        if model == "gemma":  # the wrapper made the SWA model fit for reuse, and said so
            assert any(n["change"] == "--swa-full" for n in wrapper.status()["argv_changes"])
        turn = complete(wrapper.url, first)
        history = turn["tokens_evaluated"] + turn["tokens_predicted"]
        assert wrapper.stop() == 0
    folder = model_dir(slots_dir)
    sidecar = json.loads(sidecar_file(folder).read_text())
    assert sidecar["tokens"] >= turn["tokens_evaluated"]
    assert sidecar.get("tail_bytes", sidecar["bytes"]) == kv_file(folder).stat().st_size  # chunked: the tail
    assert sidecar["swa_full"] is (model == "gemma") and sidecar["kv_streams"] == 1
    assert sidecar["chunks"]["count"] == min(history, sidecar["tokens"]) // 256  # kept as chunks and a tail
    assert sidecar["chunks"]["streams"][0]["section"] == 0  # the global layers' section

    with running(tmp_path, argv, config) as wrapper:
        report = restore_report(wrapper)
        assert [(r["slot"], r["outcome"], r["tokens"]) for r in report] == [(0, "restored", sidecar["tokens"])]
        restored_at = [e["timestamp"] for e in wrapper.events("slots.restored")]
        assert restored_at and restored_at[0] < wrapper.events("wrapper.ready")[0]["timestamp"]
        nxt = complete(wrapper.url, first + turn["content"] + " Chapter two.")
        cache_n = nxt["timings"]["cache_n"]
        assert cache_n >= 0.95 * history, (cache_n, history)
        entry = wait_for(lambda: next((r for r in restore_report(wrapper) if r.get("reused_tokens") is not None), None),
                         10, "the reuse to be reported")
        assert entry["reused_tokens"] == cache_n
        assert wrapper.events("slots.reused")[0]["cache_n"] == cache_n
        assert wrapper.stop() == 0


def test_two_slots_two_conversations_both_restored(
        tmp_path: Path, slots_dir: Path, server_bin: str, tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "8192", "-np", "2"]
    config = PERSIST.format(dir=slots_dir, swa_full="auto")
    texts = [prompt(700, "First conversation."), prompt(500, "Second, different conversation.")]
    with running(tmp_path, argv, config) as wrapper:
        turns = [complete(wrapper.url, text, slot) for slot, text in enumerate(texts)]
        assert wrapper.stop() == 0
    with running(tmp_path, argv, config) as wrapper:
        report = restore_report(wrapper)
        assert [(r["slot"], r["outcome"]) for r in report] == [(0, "restored"), (1, "restored")]
        for slot, (text, turn) in enumerate(zip(texts, turns, strict=True)):
            nxt = complete(wrapper.url, text + turn["content"] + " And then.", slot)
            assert nxt["timings"]["cache_n"] >= 0.95 * (turn["tokens_evaluated"] + turn["tokens_predicted"])
        reused = restore_report(wrapper)
        assert all(r["reused_tokens"] for r in reused)
        assert wrapper.stop() == 0



def test_the_reuse_of_a_chat_is_proven_with_several_slots(
        tmp_path: Path, slots_dir: Path, server_bin: str, demo_path: str) -> None:
    """OpenAI answers do not name their slot. With -np 4 the next turn reused 2,060 tokens, yet status said 0
    and the log warned slots.not_reused (read from /slots, whose cache count is 0 there): the answer's own
    timings count, given to the slot that served it."""
    argv = [server_bin, "-m", demo_path, "-c", "8192", "-np", "4"]
    config = PERSIST.format(dir=slots_dir, swa_full="auto")
    messages = [{"role": "user", "content": prompt(400, "Summarise this story.")}]
    with running(tmp_path, argv, config) as wrapper:
        first = chat(wrapper.url, messages)
        assert wrapper.stop() == 0
    with running(tmp_path, argv, config) as wrapper:
        assert [r["outcome"] for r in restore_report(wrapper)] == ["restored"]
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        cache_n = chat(wrapper.url, messages)["timings"]["cache_n"]
        assert cache_n >= 0.9 * first["usage"]["prompt_tokens"]
        entry = wait_for(lambda: next((r for r in restore_report(wrapper) if r.get("reused_tokens") is not None), None),
                         10, "the reuse to be reported")
        assert entry["reused_tokens"] == cache_n and entry["reused_share"] > 0.9
        assert wrapper.events("slots.reused") and not wrapper.events("slots.not_reused")


def test_a_sliding_window_file_cut_in_its_second_section_is_skipped(
        tmp_path: Path, slots_dir: Path, server_bin: str, gemma_path: str) -> None:
    """Gemma's first KV section holds only its global layers: a file cut inside the sliding-window section passed
    the check of the first one, and llama-server aborted restoring it (the wrapper exited 134, never ready)."""
    argv = [server_bin, "-m", gemma_path, "-c", "4096", "-np", "1"]
    folder = save_one(tmp_path, argv, slots_dir)
    data = kv_file(folder).read_bytes()
    sections = list(kvfile.walk(data, kvfile.header(data).words_end))
    assert len(sections) == 2  # the global layers, then the sliding-window ones
    kv_file(folder).write_bytes(data[:int(len(data) * 0.6)])
    reseal(folder)
    reason = skipped_reason(tmp_path, argv, slots_dir)
    assert reason.startswith("unreadable file") and "truncated" in reason, reason
    assert not (folder / layout.SET_ASIDE).exists()


def save_one(tmp_path: Path, argv: list[str], slots_dir: Path, words: int = 300) -> Path:
    with running(tmp_path, argv, PERSIST.format(dir=slots_dir, swa_full="auto") + WHOLE) as wrapper:
        complete(wrapper.url, prompt(words, "Saved once."))
        assert wrapper.stop() == 0
    return model_dir(slots_dir)


def skipped_reason(tmp_path: Path, argv: list[str], slots_dir: Path, swa_full: str = "auto") -> str:
    """Start with persistence, check the skip, and that the cold server still answers. A skip of another layout
    of the same tokens may have been prefilled by the background warm-up already (slots.warm): its reason stays."""
    with running(tmp_path, argv, PERSIST.format(dir=slots_dir, swa_full=swa_full) + WHOLE) as wrapper:
        report = restore_report(wrapper)
        assert len(report) == 1, report
        assert report[0]["outcome"] == "skipped" or (report[0]["outcome"] == "prefilled"
                                                     and report[0].get("warmable")), report
        assert complete(wrapper.url, "Still works.")["tokens_predicted"] > 0
        assert wrapper.stop() == 0
        return str(report[0]["reason"])


@pytest.mark.parametrize(("damage", "reason"), [
    ("truncated", "an interrupted save?"),  # the sidecar recorded another size
    ("truncated, the sidecar agreeing", "unreadable file"),
    ("0xFFFFFFFF cells, the sidecar agreeing", "unreadable file: KV cell count 4294967295 does not fit"),
])
def test_a_damaged_file_is_skipped_and_the_server_comes_up_cold(
        tmp_path: Path, slots_dir: Path, server_bin: str, tiny_path: str, damage: str, reason: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    folder = save_one(tmp_path, argv, slots_dir)
    data = bytearray(kv_file(folder).read_bytes())
    if damage.startswith("0xFFFFFFFF"):
        n_words = struct.unpack_from("<I", data, 8)[0]
        struct.pack_into("<I", data, 12 + 4 * n_words + 4, 0xFFFFFFFF)  # after the tokens and the stream count
    else:
        data = data[: len(data) // 3]
    kv_file(folder).write_bytes(bytes(data))
    if "sidecar agreeing" in damage:
        reseal(folder)
    assert reason in skipped_reason(tmp_path, argv, slots_dir)


def test_file_of_another_model_is_skipped(
        tmp_path: Path, slots_dir: Path, server_bin: str, tiny_path: str, other_tiny_path: str) -> None:
    other = save_one(tmp_path, [server_bin, "-m", other_tiny_path, "-c", "2048", "-np", "1"], tmp_path / "other")
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    ours = save_one(tmp_path, argv, slots_dir)
    for path in (*other.glob("held-*.json"), sidecar_file(other), kv_file(other)):  # its note names its state
        shutil.copy(path, ours / path.name)
    assert skipped_reason(tmp_path, argv, slots_dir).startswith("other model: saved for tiny-llama-3")


def test_file_with_other_cache_types_is_converted_or_skipped(tmp_path: Path, slots_dir: Path, server_bin: str,
                                                             tiny_path: str) -> None:
    """A start with other -ctk/-ctv converts the saved file when it can (q8_0), else skips it (q5_0)."""
    save_one(tmp_path, [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"], slots_dir)
    quantized = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1", "-fa", "on"]
    with running(tmp_path, [*quantized, "-ctk", "q8_0", "-ctv", "q8_0"],
                 PERSIST.format(dir=slots_dir, swa_full="auto")) as wrapper:
        (report,) = restore_report(wrapper)
        assert report["outcome"] == "restored" and report["conversion"]["to"] == "q8_0/q8_0", report
        assert wrapper.stop() == 0
    reason = skipped_reason(tmp_path, [*quantized, "-ctk", "q5_0", "-ctv", "q5_0"], slots_dir)
    assert reason == "cache types: the file has K q8_0 / V q8_0, the server runs K q5_0 / V q5_0"


def test_file_of_another_state_version_is_skipped(tmp_path: Path, slots_dir: Path, server_bin: str,
                                                  tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    folder = save_one(tmp_path, argv, slots_dir)
    with open(kv_file(folder), "r+b") as handle:  # what an older llama-server build would have written
        handle.seek(4)
        handle.write(struct.pack("<I", 2))
    reseal(folder)
    reason = skipped_reason(tmp_path, argv, slots_dir)
    assert reason.startswith("state version 2") and "reads version 4" in reason


def test_swa_model_without_swa_full_is_skipped(tmp_path: Path, slots_dir: Path, server_bin: str,
                                               gemma_path: str) -> None:
    argv = [server_bin, "-m", gemma_path, "-c", "2048", "-np", "1"]
    folder = save_one(tmp_path, argv, slots_dir, words=100)
    sidecar = json.loads(sidecar_file(folder).read_text())
    assert sidecar["swa_full"] is True
    reason = skipped_reason(tmp_path, argv, slots_dir, swa_full="never")
    assert reason.startswith("sliding-window model without --swa-full")


def test_an_empty_slot_never_overwrites_a_good_file(tmp_path: Path, slots_dir: Path, server_bin: str,
                                                    tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    folder = save_one(tmp_path, argv, slots_dir)
    names = [*(p.name for p in folder.glob("held-*.json")), sidecar_file(folder).name, kv_file(folder).name]
    before = {name: (folder / name).read_bytes() for name in names}
    with running(tmp_path, argv, SAVE_ONLY.format(dir=slots_dir) + WHOLE) as wrapper:  # no restore: empty slot
        assert wrapper.stop() == 0
    assert {name: (folder / name).read_bytes() for name in before} == before
    saves = wrapper.events("hook.run")
    assert saves[-1]["action"] == "slots.save" and saves[-1]["detail"].startswith("saved 0 slot(s)")
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # no temporary left


def test_client_slot_actions_are_refused_unless_allowed(tmp_path: Path, slots_dir: Path, server_bin: str,
                                                       tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1"]
    with running(tmp_path, argv, PERSIST.format(dir=slots_dir, swa_full="auto")) as wrapper:
        assert http("POST", f"{wrapper.url}/slots/0?action=erase")[0] == 403
        assert http("GET", f"{wrapper.url}/slots")[0] == 200
        wrapper.stop()
    allowed = PERSIST.format(dir=slots_dir, swa_full="auto") + "proxy: {allow_slot_actions: true}\n"
    with running(tmp_path, argv, allowed) as wrapper:
        assert http("POST", f"{wrapper.url}/slots/0?action=erase")[0] == 200
        wrapper.stop()


def test_persistence_works_behind_an_api_key(tmp_path: Path, slots_dir: Path, server_bin: str, tiny_path: str) -> None:
    """The wrapper's own slot calls carry the key the user gave llama-server."""
    argv = [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1", "--api-key", "sesame"]
    with running(tmp_path, argv, PERSIST.format(dir=slots_dir, swa_full="auto")) as wrapper:
        body = {"prompt": prompt(50, "Keyed."), "n_predict": 2}
        assert http("POST", f"{wrapper.url}/completion", body)[0] == 401  # the proxy adds no credentials
        status, _, _ = http("POST", f"{wrapper.url}/completion", body, headers={"Authorization": "Bearer sesame"})
        assert status == 200
        assert wrapper.stop() == 0
    assert json.loads(sidecar_file(model_dir(slots_dir)).read_text())["tokens"] > 0
