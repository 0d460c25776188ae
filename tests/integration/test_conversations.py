"""The conversation cache against the real llama-server: conversations that left their slot come back across
restarts, reloads and wrappers, only when a restore pays, within a disk budget, and nothing is written twice."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from hooks.degrade.memory import Choices, MiB, plan, read_shape
from tests.helpers import Wrapper, http, running

TOKEN = "conversations-token"
CONFIG = """
slots: {{dir: {dir}}}
cache: {{{extra}}}
store: {{{store}}}
priority: {{lane: false}}  # one slot per -np: these tests count what moves in and out of it
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
FILLER = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "


STORE_KEYS = ("budget", "entry_max", "min_free", "chunk_tokens")  # the store's section: what the folder holds


def config(tmp_path: Path, **settings: Any) -> str:
    cache = ", ".join(f"{key}: {value}" for key, value in settings.items() if key not in STORE_KEYS)
    store = ", ".join(f"{key}: {value}" for key, value in settings.items() if key in STORE_KEYS)
    return CONFIG.format(dir=tmp_path / "slots", extra=cache, store=store)


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
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, budget=budget)) as wrapper:
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


# -- the three defects: two hosts on one store, a regenerate, a growth after a cache restore ----------


def test_two_wrappers_stopped_at_the_same_moment_both_come_back_on_a_third(tmp_path: Path, server_bin: str,
                                                                           demo_path: str) -> None:
    """Two hosts on one slot folder: each stop's states are entries named by what they hold, so neither
    overwrites the other's (each slot once wrote `slot0.json`, and the second stop won)."""
    x, y = Chat("X"), Chat("Y")
    shared = config(tmp_path)
    with running(tmp_path, argv(server_bin, demo_path), shared) as a, \
            running(tmp_path, argv(server_bin, demo_path), shared) as b:
        x.turn(a.url)
        y.turn(b.url)
        a.signal_group()  # both stopped at the same moment, as two hosts' llama-swaps may
        b.signal_group()
        assert a.wait() == 0 and b.wait() == 0
    with running(tmp_path, argv(server_bin, demo_path), shared) as c:
        assert x.turn(c.url) >= 0.9
        assert y.turn(c.url) >= 0.9


def test_a_running_wrapper_continues_what_another_saved_at_its_stop(tmp_path: Path, server_bin: str,
                                                                   demo_path: str) -> None:
    """A lookup sees what other hosts committed since it last looked."""
    w, z = Chat("W"), Chat("Z")
    shared = config(tmp_path)
    with running(tmp_path, argv(server_bin, demo_path), shared) as d:
        w.turn(d.url)  # d has looked at the folder
        with running(tmp_path, argv(server_bin, demo_path), shared) as e:
            z.turn(e.url)
            assert e.stop() == 0
        assert z.turn(d.url) >= 0.9
        assert conversations(d)["decisions"][-1]["choice"] == "restore"


def test_a_regenerate_after_a_restart_goes_to_the_slot_that_holds_its_question(tmp_path: Path, server_bin: str,
                                                                              demo_path: str) -> None:
    """The same question again (a front-end's "regenerate": the history without the last answer) shares only
    its ~300 tokens with the ~800 its slot holds: that slot still reuses the most."""
    two = [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"]
    question = {"messages": [{"role": "user", "content": "A question. " + FILLER * 16}], "max_tokens": 500,
                "ignore_eos": True, "temperature": 0}
    with running(tmp_path, two, config(tmp_path)) as wrapper:
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", question, timeout=600)
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 500, raw[:300]
        assert wrapper.stop() == 0
    with running(tmp_path, two, config(tmp_path)) as wrapper:
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", {**question, "max_tokens": 4},
                              timeout=600)
        assert status == 200, raw[:300]
        again = json.loads(raw)
        prompt = again["usage"]["prompt_tokens"]
        assert prompt >= 280 and again["timings"]["cache_n"] >= 0.9 * prompt, again["timings"]


def test_a_growth_after_a_cache_restore_brings_back_what_the_slot_held(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    """A conversation back from the cache counted as unchanged since the last save, so the growth's save skipped
    it and the new server got the slot's older saved state (as-given holds 2k tokens, the request needs more)."""
    budget = plan(read_shape(demo_path), Choices(n_ctx=2048)).total() + MiB
    grows = config(tmp_path) + f"degrade: {{budget: {budget}}}\n"
    one = [server_bin, "-m", demo_path, "-np", "1"]
    text = "Chapter one. " + FILLER * 30  # ~600 tokens
    with running(tmp_path, one, grows) as wrapper:
        text += complete(wrapper.url, text)["content"]
        assert wrapper.stop() == 0  # the slot's state is kept: ~600 tokens
    with running(tmp_path, one, grows) as wrapper:
        text += " Chapter two. " + FILLER * 45  # ~1.5k tokens
        longer = complete(wrapper.url, text)
        held = longer["tokens_evaluated"] + longer["tokens_predicted"] - 1
        text += longer["content"]
        complete(wrapper.url, "Another conversation. " + FILLER * 20)  # the long one leaves: into the cache
        grown = complete(wrapper.url, text + " Chapter three. " + FILLER * 45)  # back from the cache, overflows
        assert wrapper.status()["degrade"]["rung"] != "as-given"
        assert grown["timings"]["cache_n"] >= 0.95 * held, (grown["timings"], held)


def complete(url: str, prompt: str) -> dict[str, Any]:
    status, _, raw = http("POST", f"{url}/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0},
                          timeout=600)
    assert status == 200, raw[:300]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def test_a_short_question_with_a_long_answer_that_leaves_its_slot_comes_back_after_a_restart(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """What a slot holds is its prompt and the answer it generated: a 44-token question with a 300-token answer is
    a conversation worth keeping when another takes its only slot, though its prompt alone is shorter than
    cache.min_tokens (it was lost: its next turn after a restart read 24 of 344 tokens from the cache)."""
    question = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper and his ledger."}]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions",
                              {"messages": question, "max_tokens": 300, "temperature": 0, "ignore_eos": True},
                              timeout=600)
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        assert answer["usage"]["prompt_tokens"] < 256 <= history  # its prompt alone is under cache.min_tokens
        other = http("POST", f"{wrapper.url}/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
        assert other[0] == 200
        (saved,) = wrapper.events("conversations.saved")  # it left its slot: kept
        assert saved["tokens"] >= history - 1 and saved["why"] == "it leaves its slot"
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        turn = [*question, answer["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions",
                              {"messages": turn, "max_tokens": 8, "temperature": 0}, timeout=600)
        assert status == 200, raw[:300]
        reused = json.loads(raw)["timings"]["cache_n"]
        assert reused >= 0.9 * history, (reused, history)
        assert wrapper.stop() == 0
