"""The conversation cache against the real llama-server: conversations that left their slot come back across
restarts, reloads and wrappers, only when a restore pays, within a disk budget, and nothing is written twice."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tests.helpers import Wrapper, http, running

TOKEN = "conversations-token"
CONFIG = """
slots: {{dir: {dir}{extra}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
FILLER = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "


def config(tmp_path: Path, **slots: Any) -> str:
    extra = "".join(f", {key}: {value}" for key, value in slots.items())
    return CONFIG.format(dir=tmp_path / "slots", extra=extra)


class Chat:
    def __init__(self, name: str, size: int = 25) -> None:
        self.messages = [{"role": "user", "content": f"Conversation {name}. " + FILLER * size}]
        self.history = 0

    def turn(self, url: str) -> float:
        """One turn; the share of the conversation so far that came from the cache."""
        status, _, raw = http("POST", f"{url}/v1/chat/completions",
                              {"messages": self.messages, "max_tokens": 8, "temperature": 0}, timeout=600)
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        reused = answer["timings"]["cache_n"] / self.history if self.history else 0.0
        self.history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        self.messages += [answer["choices"][0]["message"], {"role": "user", "content": "Go on."}]
        return float(reused)


def argv(server_bin: str, demo_path: str) -> list[str]:
    return [server_bin, "-m", demo_path, "-c", "8192", "-np", "1"]


def conversations(wrapper: Wrapper) -> dict[str, Any]:
    found: dict[str, Any] = wrapper.status()["slots"]["conversations"]
    return found


def test_conversations_come_back_after_a_restart_and_a_second_stop_writes_nothing(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    chats = [Chat(name) for name in "ABC"]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        for chat in chats:
            chat.turn(wrapper.url)  # each one pushes the one before out of the only slot: it is kept on disk
        assert conversations(wrapper)["count"] == 2
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        reused = [chat.turn(wrapper.url) for chat in chats]  # A and B from the cache, C from its slot file
        assert all(share >= 0.9 for share in reused), reused
        assert [d["choice"] for d in conversations(wrapper)["decisions"]] == ["restore", "restore", "restore"]
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        assert wrapper.stop() == 0
        assert not wrapper.events("slots.saved") and not wrapper.events("conversations.saved")
        assert wrapper.events("slots.unchanged")


def test_the_disk_budget_holds_and_the_most_recent_come_back(tmp_path: Path, server_bin: str,
                                                              demo_path: str) -> None:
    chats = [Chat(name) for name in "ABCDE"]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        chats[0].turn(wrapper.url)
        chats[1].turn(wrapper.url)
        entry = conversations(wrapper)["entries"][0]["bytes"]
    budget = int(2.5 * entry)  # room for two of them
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, cache_budget=budget)) as wrapper:
        for chat in chats[2:]:
            chat.turn(wrapper.url)
        cache = conversations(wrapper)
        assert cache["bytes"] <= budget and cache["count"] == 2
        assert chats[3].turn(wrapper.url) >= 0.9  # D: recent, kept
        assert chats[0].turn(wrapper.url) < 0.5  # A: the least recently used, evicted: prefilled


def test_a_conversation_begun_on_one_wrapper_continues_on_another_from_the_shared_store(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    chat, other = Chat("X"), Chat("Y")
    shared = config(tmp_path)  # one slot folder for both: an NFS export or a ReadWriteMany volume
    with running(tmp_path, argv(server_bin, demo_path), shared) as first, \
            running(tmp_path, argv(server_bin, demo_path), shared) as second:
        chat.turn(first.url)
        other.turn(first.url)  # X leaves the first one's slot: into the shared store
        assert chat.turn(second.url) >= 0.9
        assert [d["choice"] for d in conversations(second)["decisions"]] == ["restore"]


def test_a_restore_slower_than_a_prefill_is_not_done_and_the_log_says_why(tmp_path: Path, server_bin: str,
                                                                          demo_path: str) -> None:
    chat, other = Chat("slow"), Chat("other")
    slow = config(tmp_path, restore_rate="1KB")  # a disk that reads 1 KB/s: as if throttled
    with running(tmp_path, argv(server_bin, demo_path), slow) as wrapper:
        chat.turn(wrapper.url)
        other.turn(wrapper.url)  # "slow" leaves its slot: into the cache
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), slow) as wrapper:  # no RAM prompt cache to help now
        assert chat.turn(wrapper.url) < 0.5  # prefilled
        (decision,) = [e for e in wrapper.events("conversations.decision") if e["entry_tokens"] > 256]
        assert decision["choice"] == "prefill" and decision["why"] == "a prefill is quicker"
        assert decision["predicted_restore_s"] > decision["predicted_prefill_s"] > 0
        assert not wrapper.events("conversations.restored")


def test_a_reload_while_other_clients_use_the_only_slot_keeps_the_conversation(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    chat = Chat("long", size=80)
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        chat.turn(wrapper.url)
        answers: list[int] = []
        reload = threading.Thread(target=lambda: answers.append(http(
            "POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0"},
            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)[0]))
        reload.start()
        short = [Chat(f"short {i}", size=1) for i in range(4)]
        for each in short:
            each.turn(wrapper.url)
        reload.join(600)
        assert answers == [200]
        assert chat.turn(wrapper.url) >= 0.95  # from the cache, converted to the new cache types on the way
        assert wrapper.events("conversations.converted") or wrapper.events("slots.converted")
