"""Each consumer's conversations are its own, against the real llama-server and the real S3 server (SeaweedFS), on
the README's config (`examples/chat.yaml` as it is) with `consumers:` added: two people and an agent, each with its
key, and a public system prompt. A consumer sending another's exact conversation reuses nothing past that prompt —
from a slot, the folder or the bucket — and its first token comes no sooner than a fresh prompt's (the table the
test prints); the owner's own next turn is still served from each tier."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.helpers import Wrapper, chat_yaml, http, running, wait_for
from tests.s3server import S3Server

SYSTEM = "You are the help desk of the Northern Lighthouse Board. Answer briefly and politely."
KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567", "agent": "sk-agent-89ab"}
CONSUMERS = f"""
consumers:
  keys: {{alice: ["{KEYS['alice']}"], bob: ["{KEYS['bob']}"], agent: ["{KEYS['agent']}"]}}
  shared_prefix:
    messages: [{{role: system, content: "{SYSTEM}"}}]
"""
STORE = "store: {{url: {url}, refresh: 1s, timeout: 3s}}\n"
FILLER = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "


def conversation(topic: str, size: int = 40) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{topic}. " + FILLER * size + "What did the keeper write?"}]


def ask(url: str, who: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer of one token at temperature 0, as `who` (its key); its timings and how long it took."""
    began = time.monotonic()
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": messages, "max_tokens": 1, "temperature": 0}, timeout=600,
                          headers={"Authorization": f"Bearer {KEYS[who]}"} if who in KEYS else {})
    assert status == 200, raw[:300]
    answer = json.loads(raw)
    return {"cache_n": answer["timings"]["cache_n"], "prompt_n": answer["timings"]["prompt_n"],
            "s": time.monotonic() - began, "answer": answer}


def consumers(wrapper: Wrapper) -> dict[str, Any]:
    found: dict[str, Any] = wrapper.status()["slots"]["conversations"]["consumers"]
    return found


def argv(server_bin: str, demo_path: str) -> list[str]:
    return [server_bin, "-m", demo_path, "-c", "8192", "-np", "1"]


def test_no_consumer_is_served_from_anothers_conversation_on_any_tier(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    """Alice keeps three conversations, one for each tier; bob sends each once, when it is in that tier only."""
    store = STORE.format(url=s3.store("consumers"))
    in_slot, in_folder, in_bucket = (conversation(f"Alice's question about the ledger of {year}")
                                     for year in (1907, 1908, 1909))
    rows: list[tuple[str, str, dict[str, Any]]] = []
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "a", CONSUMERS + store),
                 env=s3.env()) as a:
        assert consumers(a)["isolate"] is True
        for each in (in_bucket, in_folder, in_slot):
            ask(a.url, "alice", each)
        public = consumers(a)["shared_prefix_tokens"]
        assert public and public > 10
        # the slot tier: bob sends alice's exact conversation while it is in a slot
        rows.append(("slot", "bob sends alice's", ask(a.url, "bob", in_slot)))
        rows.append(("slot", "alice goes on", ask(a.url, "alice", in_slot)))
        rows.append(("slot", "bob's fresh prompt", ask(a.url, "bob", conversation("Bob's question about the ship"))))
        # the folder tier: two longer conversations of hers take both slots (the shortest leaves first)
        for n in (1, 2):
            ask(a.url, "alice", conversation(f"Alice's other question {n}", size=45))
        rows.append(("folder", "bob sends alice's", ask(a.url, "bob", in_folder)))
        rows.append(("folder", "alice goes on", ask(a.url, "alice", in_folder)))
        fresh = conversation("Bob's question about the keeper")
        rows.append(("folder", "bob's fresh prompt", ask(a.url, "bob", fresh)))
        restored = [d for d in a.status()["slots"]["conversations"]["decisions"] if d["choice"] == "restore"]
        assert restored, "alice's own conversation came back from the folder"
        by_name = consumers(a)["by_name"]
        assert by_name["alice"]["hits"] >= 1 and by_name["bob"]["hits"] == 0, by_name
        assert by_name["alice"]["entries"] >= 1 and by_name["alice"]["folder_bytes"] > 0, by_name
        text = json.dumps(a.status()) + a.log_path.read_text()
        assert not any(key in text for key in KEYS.values()), "a key is never shown"
        wait_for(lambda: a.status()["slots"]["tiers"]["store"]["pending"] == 0, 60, "a's uploads")
    # the bucket tier: another host on the same bucket, its folder empty
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "b", CONSUMERS + store),
                 env=s3.env()) as b:
        wait_for(lambda: b.status()["slots"]["tiers"]["store"]["entries"] >= 3, 20, "b to see the bucket")
        rows.append(("bucket", "bob sends alice's", ask(b.url, "bob", in_bucket)))
        rows.append(("bucket", "alice goes on", ask(b.url, "alice", in_bucket)))
        rows.append(("bucket", "bob's fresh prompt", ask(b.url, "bob", conversation("Bob's question about the lamp"))))
        assert b.events("store.fetched"), "alice's own conversation came from the bucket"
    print(f"\n{'tier':<7} {'request':<20} {'reused':>7} {'read':>6} {'first token':>12}")
    for tier, what, row in rows:
        print(f"{tier:<7} {what:<20} {row['cache_n']:>7} {row['prompt_n']:>6} {row['s']:>11.3f}s")
    for tier, what, row in rows:
        if what == "bob sends alice's":
            assert row["cache_n"] <= public, (tier, row["cache_n"], public)
        if what == "alice goes on":
            assert row["cache_n"] >= 0.9 * (row["cache_n"] + row["prompt_n"]), (tier, row)


def test_without_isolation_the_same_request_is_served_from_anothers_slot(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """The leak the isolation closes, shown on the same config with `isolate: false`: bob's copy of alice's
    conversation reuses all of it (the test above would then fail)."""
    secret = conversation("Alice's question about the ledger of 1907")
    with running(tmp_path, argv(server_bin, demo_path),
                 chat_yaml(tmp_path, CONSUMERS + "  isolate: false\n")) as wrapper:
        ask(wrapper.url, "alice", secret)
        copied = ask(wrapper.url, "bob", secret)
        assert copied["cache_n"] > 0.9 * (copied["cache_n"] + copied["prompt_n"])
