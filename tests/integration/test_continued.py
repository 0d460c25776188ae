"""The next turn of a conversation its slot holds goes on there without its history templated or tokenized again
(hooks/conversations/chain.py), against the real llama-server: as much reused as the whole lookup gave, streamed
or not, two conversations in their own slots, an edited message and a restart taking the whole lookup again, and
what the book learnt still right when a conversation leaves its slot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import http, running
from tests.integration.test_conversations import FILLER, config, conversations


class Chat:
    def __init__(self, name: str, size: int = 25) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": f"Conversation {name}. " + FILLER * size}]
        self.history = 0

    def turn(self, url: str, stream: bool = False) -> float:
        """One turn; the share of the conversation so far the server reused."""
        body = {"messages": self.messages, "max_tokens": 8, "temperature": 0, "stream": stream}
        status, _, raw = http("POST", f"{url}/v1/chat/completions", body, timeout=600)
        assert status == 200, raw[:300]
        if stream:
            events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            content = "".join((e["choices"][0]["delta"].get("content") or "") for e in events if e.get("choices"))
            timings = next(e["timings"] for e in reversed(events) if "timings" in e)
            total = timings["cache_n"] + timings["prompt_n"] + timings["predicted_n"]
        else:
            answer = json.loads(raw)
            content, timings = answer["choices"][0]["message"]["content"], answer["timings"]
            total = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        reused = timings["cache_n"] / self.history if self.history else 0.0
        self.history = total
        self.messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
        return float(reused)


def argv(server_bin: str, demo_path: str, parallel: int = 1) -> list[str]:
    return [server_bin, "-m", demo_path, "-c", str(8192 * parallel), "-np", str(parallel)]


def lookups(wrapper: Any) -> int:
    """Requests the conversation cache templated, tokenized and looked up."""
    cache = conversations(wrapper)
    return int(cache["hits"] + sum(cache["misses"].values()))


def test_next_turns_go_on_in_their_slots_without_a_lookup_and_reuse_as_much(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    a, b = Chat("A"), Chat("B")
    with running(tmp_path, argv(server_bin, demo_path, parallel=2), config(tmp_path)) as wrapper:
        a.turn(wrapper.url)
        b.turn(wrapper.url)
        assert conversations(wrapper)["continued"] == 0 and lookups(wrapper) == 2
        shares = []
        for turn in range(3):  # alternately, streamed and not: each stays in its own slot
            shares += [a.turn(wrapper.url, stream=turn == 1), b.turn(wrapper.url, stream=turn == 2)]
        assert all(share >= 0.95 for share in shares), shares
        cache = conversations(wrapper)
        assert cache["continued"] == 6 and lookups(wrapper) == 2
        assert not wrapper.events("conversations.saved")  # nothing left a slot
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path, parallel=2), config(tmp_path)) as wrapper:
        assert a.turn(wrapper.url) >= 0.95 and b.turn(wrapper.url) >= 0.95  # restored at the start: looked up
        cache = conversations(wrapper)
        assert cache["continued"] == 0 and cache["hits"] == 2 and not cache["misses"]  # the start's restores hit
        assert a.turn(wrapper.url) >= 0.95 and conversations(wrapper)["continued"] == 1


def test_an_edited_message_takes_the_whole_lookup_and_what_leaves_a_slot_is_kept_whole(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    chat, other = Chat("E"), Chat("other")
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        for _ in range(3):
            chat.turn(wrapper.url)
        assert conversations(wrapper)["continued"] == 2
        edited = Chat("E")
        edited.messages = [dict(m) for m in chat.messages]
        edited.messages[0]["content"] = "Edited. " + edited.messages[0]["content"]
        edited.history = chat.history
        assert edited.turn(wrapper.url) < 0.5  # another conversation: prefilled from the edit on
        assert conversations(wrapper)["continued"] == 2 and lookups(wrapper) == 2
        assert edited.turn(wrapper.url) >= 0.95 and conversations(wrapper)["continued"] == 3
        other.turn(wrapper.url)  # the edited conversation leaves the only slot: saved whole (what the server held)
        first, saved = [e for e in wrapper.events("conversations.saved") if e["why"] == "it leaves its slot"]
        assert first["tokens"] >= chat.history - 8  # the conversation before the edit left for the edited one
        assert saved["tokens"] >= edited.history - 8  # its last answer too, although its tokens were never told
        assert edited.turn(wrapper.url) >= 0.95  # restored: looked up, not continued
        assert conversations(wrapper)["decisions"][-1]["choice"] == "restore"


def test_with_cache_reuse_every_turn_takes_the_whole_lookup(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    chat = Chat("shifted")  # --cache-reuse: cache_n counts chunks reused out of place, not what a slot holds first
    with running(tmp_path, [*argv(server_bin, demo_path), "--cache-reuse", "256"], config(tmp_path)) as wrapper:
        shares = [chat.turn(wrapper.url) for _ in range(3)]
        assert all(share >= 0.95 for share in shares[1:]), shares
        assert conversations(wrapper)["continued"] == 0 and lookups(wrapper) == 3


def test_nothing_a_slot_holds_is_overwritten_unsaved_after_a_refused_request_or_an_untold_turn(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    short = Chat("short", size=1)  # its first turn under cache.min_tokens: it grows untold, turn by turn
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        short.turn(wrapper.url)
        for _ in range(3):
            short.messages[-1]["content"] = "Go on, at length. " + FILLER * 4
            short.turn(wrapper.url)
        assert conversations(wrapper)["continued"] == 3 and short.history > 256
        status, _, _ = http("POST", f"{wrapper.url}/v1/chat/completions", {"messages": "hello", "max_tokens": 4})
        assert status == 400  # refused by llama-server: it ran in no slot
        cold: dict[str, Any] = {"messages": [{"role": "user", "content": "Cache off. " + FILLER * 20}],
                                "max_tokens": 4, "cache_prompt": False}
        Chat("other").turn(wrapper.url)  # takes the only slot: what it held is saved first
        saved = [e for e in wrapper.events("conversations.saved") if e["why"] == "it leaves its slot"]
        assert [e["tokens"] >= short.history - 8 for e in saved] == [True], saved
        assert short.turn(wrapper.url) >= 0.95  # restored whole
        assert http("POST", f"{wrapper.url}/v1/chat/completions", cold)[0] == 200
        cold["messages"] += [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "More."}]
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", cold)
        assert status == 200 and json.loads(raw)["timings"]["cache_n"] == 0  # went on in its slot, reusing 0
        Chat("third").turn(wrapper.url)  # the cache-off conversation leaves: saved whole all the same
        last = [e for e in wrapper.events("conversations.saved") if e["why"] == "it leaves its slot"][-1]
        assert last["tokens"] >= json.loads(raw)["usage"]["prompt_tokens"], last
