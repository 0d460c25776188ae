"""Each consumer's conversations are its own, against the real llama-server and the real S3 server (SeaweedFS), on
the configs users copy (`examples/team.yaml` as it is, or `examples/chat.yaml` with `consumers:` added): two people
and an agent, each with its key, and a public system prompt. A consumer sending another's exact conversation reuses
nothing past that prompt — from a slot, the folder or the bucket — and its first token comes no sooner than a fresh
prompt's (the table the test prints); the owner's own next turn is still served from each tier. Shares hold under an
agent's flood; a forgotten consumer leaves nothing on any host; a sealed bucket is of no use without its key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, Wrapper, chat_yaml, http, running, wait_for
from tests.s3server import S3Server

SYSTEM = "You are the team assistant. Answer briefly."  # examples/team.yaml's shared_prefix
KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567", "agent": "sk-agent-89ab"}
FRONT_END_KEY = "sk-owui-cdef"  # examples/team.yaml's open-webui: one key for all of its users
CONSUMERS = f"""
consumers:
  keys: {{alice: ["{KEYS['alice']}"], bob: ["{KEYS['bob']}"], agent: ["{KEYS['agent']}"]}}
  shared_prefix:
    messages: [{{role: system, content: "{SYSTEM}"}}]
"""


def team_yaml(tmp_path: Path, more: str = "") -> str:
    """examples/team.yaml as it is, but for its folder and the keys (its ci-agent's is the agent's here)."""
    text = (ROOT / "examples" / "team.yaml").read_text()
    assert f'content: "{SYSTEM}"' in text
    for placeholder, who in (("change-me-alice-key", "alice"), ("change-me-bob-key", "bob"),
                             ("change-me-agent-key", "agent")):
        assert placeholder in text
        text = text.replace(placeholder, KEYS[who])
    assert "change-me-open-webui-key" in text and "X-OpenWebUI-User-Id" in text
    text = text.replace("change-me-open-webui-key", FRONT_END_KEY)
    return text.replace("~/.cache/llama-wrapper/slots", str(tmp_path / "slots")) + more
STORE = "store: {{url: {url}, refresh: 1s, timeout: 3s}}\n"
TOKEN = "consumers-admin-token"  # under isolation the status and /metrics are the admin's
ADMIN = {"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}


def env_of(s3: S3Server) -> dict[str, str]:
    return {**s3.env(), **ADMIN}
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
    with running(tmp_path, argv(server_bin, demo_path), team_yaml(tmp_path / "a", store), env=env_of(s3)) as a:
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
        for path in ("/wrapper/status", "/metrics", "/slots"):  # what tells each one's activity is the admin's
            status, _, raw = http("GET", a.url + path, headers={"Authorization": f"Bearer {KEYS['bob']}"})
            assert status == 401 and b"under consumers.isolate" in raw, (path, raw[:200])
        status, _, raw = http("GET", f"{a.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and b'llama_wrapper_consumer_lookups_total{consumer="alice",result="hit"}' in raw
        wait_for(lambda: a.status()["slots"]["tiers"]["store"]["pending"] == 0, 60, "a's uploads")
    # the bucket tier: another host on the same bucket, its folder empty
    with running(tmp_path, argv(server_bin, demo_path), team_yaml(tmp_path / "b", store), env=env_of(s3)) as b:
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


def delete(url: str, headers: dict[str, str], query: str = "") -> tuple[int, dict[str, Any]]:
    status, _, raw = http("DELETE", f"{url}/wrapper/conversations{query}", headers=headers, timeout=120)
    return status, json.loads(raw)


def kept_of(folder: Path, consumer: str) -> tuple[set[str], set[str]]:
    """The entries (keys) a slot folder keeps for that consumer, and the chunks they name."""
    keys, chunks = set(), set()
    for sidecar in folder.rglob("conv-*.json"):
        record = json.loads(sidecar.read_text())
        if record.get("consumer") == consumer:
            keys.add(record["key"])
            chunks.update(record.get("chunks", {}).get("names", []))
    return keys, chunks


def chunks_on_disk(folder: Path) -> set[str]:
    return {p.name[:-3] for p in folder.rglob("chunks/*.kv")}


def test_a_consumer_forgets_everything_kept_for_it_on_every_host(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    store = STORE.format(url=s3.store("consumers"))
    token = TOKEN
    mine, other, bobs = (conversation(f"Alice's question about the ledger of {y}") for y in (1910, 1911, 1912))
    env = {**s3.env(), **ADMIN}
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "a", CONSUMERS + store), env=env) as a, \
            running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "b", CONSUMERS + store), env=env) as b:
        ask(a.url, "alice", mine)
        ask(a.url, "bob", bobs)
        ask(a.url, "alice", other)  # takes bob's slot (the shortest, least recent one): bob's leaves into the folder
        for n in (1, 2):  # both slots taken by longer ones: alice's two conversations into the folder
            ask(a.url, "agent", conversation(f"The agent's task {n}", size=45))
        wait_for(lambda: a.status()["slots"]["tiers"]["store"]["pending"] == 0, 60, "a's uploads")
        wait_for(lambda: b.status()["slots"]["tiers"]["store"]["entries"] >= 3, 20, "b to see the bucket")
        assert ask(b.url, "alice", mine)["cache_n"] > 700  # fetched into b's folder, and now in b's slot
        keys, chunks = kept_of(tmp_path / "a" / "slots", "alice")
        assert keys and chunks and chunks <= chunks_on_disk(tmp_path / "a" / "slots")
        bobs_keys, bobs_chunks = kept_of(tmp_path / "a" / "slots", "bob")
        assert bobs_keys

        assert delete(a.url, {})[0] == 401  # no key: nobody to forget
        assert delete(a.url, {"Authorization": f"Bearer {KEYS['bob']}"}, "?consumer=alice")[0] == 401  # not admin
        status, answer = delete(a.url, {"Authorization": f"Bearer {KEYS['alice']}"})
        assert status == 200, answer
        assert answer["consumer"] == "alice" and answer["folder"]["entries"] >= 2, answer
        assert answer["bucket"]["entries"] >= 2, answer
        print(f"\nforget: {answer}")

        # nothing of alice's is left on a, in the bucket, or (after its next look) on b
        assert not kept_of(tmp_path / "a" / "slots", "alice")[0]
        assert not chunks & chunks_on_disk(tmp_path / "a" / "slots")
        assert bobs_chunks <= chunks_on_disk(tmp_path / "a" / "slots")  # another consumer's are untouched
        listed = s3._client().list_objects_v2(Bucket=s3.bucket, Prefix="consumers/").get("Contents", [])
        names = {o["Key"].rsplit("/", 1)[-1] for o in listed}
        assert not any(f"conv-{key}.json" in names for key in keys)
        assert not {f"{c}.kv" for c in chunks} & names
        wait_for(lambda: not kept_of(tmp_path / "b" / "slots", "alice")[0], 30, "b to forget alice's entries")
        wait_for(lambda: b.events("consumers.slots_cleared"), 30, "b to clear alice's slot")
        assert not chunks & chunks_on_disk(tmp_path / "b" / "slots")
        # her next turn on either host reads her prompt again; bob's is still kept
        public = consumers(a)["shared_prefix_tokens"]
        for host in (a, b):
            assert ask(host.url, "alice", mine)["cache_n"] <= public
        assert ask(a.url, "bob", bobs)["cache_n"] > 700
        assert kept_of(tmp_path / "a" / "slots", "bob")[0]

        # the admin forgets a named consumer for it
        status, answer = delete(a.url, {"Authorization": f"Bearer {token}"}, "?consumer=bob")
        assert status == 200 and answer["consumer"] == "bob", answer
        assert delete(a.url, {"Authorization": f"Bearer {token}"}, "?consumer=carol")[0] == 404
        assert not kept_of(tmp_path / "a" / "slots", "bob")[0]


def test_the_peoples_shares_hold_under_an_agents_flood(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    """Two people keep two conversations each; an agent floods the cache with eight. Its shares bound it (its
    oldest go, in the folder and the bucket); the people's stay whole, and come back from the folder."""
    mib = 1 << 20
    shares = f"""  shares:
    agent: {{folder: {40 * mib}, bucket: {60 * mib}}}
    alice: {{folder: {50 * mib}}}
    bob: {{folder: {50 * mib}}}
store: {{url: {s3.store("shares")}, refresh: 1s, timeout: 3s, budget: {150 * mib}}}
"""
    people = {(who, n): conversation(f"{who.title()}'s question number {n}")
              for who in ("alice", "bob") for n in (1, 2)}
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path, CONSUMERS + shares), env=env_of(s3)) as w:
        for (who, _), messages in people.items():
            ask(w.url, who, messages)
        for n in range(8):
            ask(w.url, "agent", conversation(f"The agent's task number {n}"))
        wait_for(lambda: w.status()["slots"]["tiers"]["store"]["pending"] == 0, 60, "the uploads")
        wait_for(lambda: consumers(w)["by_name"]["agent"]["bucket_bytes"] <= 60 * mib, 30, "the agent's bucket share")
        by_name = consumers(w)["by_name"]
        print(f"\nshares: { {n: {k: v for k, v in c.items() if k != 'share'} for n, c in by_name.items()} }")
        assert by_name["agent"]["folder_bytes"] <= 40 * mib and by_name["agent"]["evictions"].get("folder", 0) >= 3
        assert by_name["agent"]["evictions"].get("bucket", 0) >= 1
        for who in ("alice", "bob"):
            assert by_name[who]["entries"] == 2 and not by_name[who]["evictions"], by_name[who]
        for (who, _), messages in people.items():  # every person's conversation is still kept
            reused = ask(w.url, who, messages)
            assert reused["cache_n"] >= 0.9 * (reused["cache_n"] + reused["prompt_n"]), (who, reused)
        assert w.status()["slots"]["conversations"]["consumers"]["by_name"]["agent"]["share"] == {
            "folder": "40.0 MiB", "bucket": "60.0 MiB"}


def test_a_sealed_bucket_is_of_no_use_to_a_host_without_the_key(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    """store.encrypt: alice's conversation goes to the bucket sealed; a host with the key goes on with it, one
    without it prefills (nothing in the bucket reads as a state or its tokens), one with another key does not
    start, saying why. Sealed again under a new key (`slots rekey`, the real command): a host with the old key does
    not start, one with the new key goes on with alice's conversation from the bucket."""
    key, other = tmp_path / "key", tmp_path / "other-key"
    key.write_text("the-team-key-0123456789abcdef\n")
    other.write_text("not-the-team-key-0123456789\n")
    sealed = STORE.format(url=s3.store("sealed")).replace("timeout: 3s}", f"timeout: 3s, encrypt: {key}}}")
    plain = STORE.format(url=s3.store("sealed"))
    mine = conversation("Alice's question about the ledger of 1913")
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "a", CONSUMERS + sealed),
                 env=env_of(s3)) as a:
        ask(a.url, "alice", mine)
        for n in (1, 2):
            ask(a.url, "agent", conversation(f"The agent's task {n}", size=45))
        wait_for(lambda: a.status()["slots"]["tiers"]["store"]["pending"] == 0, 60, "a's uploads")
        assert a.status()["slots"]["tiers"]["store"]["sealed"] is True
    stored = s3._client().list_objects_v2(Bucket=s3.bucket, Prefix="sealed/").get("Contents", [])
    bodies = [s3._client().get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read() for o in stored]
    assert bodies and not any(b'"token_ids"' in body for body in bodies)
    assert all(body.startswith(b"LWSEAL1\0") for o, body in zip(stored, bodies, strict=True)
               if o["Key"].endswith((".kv", ".bin")))
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "b", CONSUMERS + plain),
                 env=env_of(s3)) as b:
        wait_for(lambda: b.status()["slots"]["tiers"]["store"]["state"] == "up", 20, "b to list the bucket")
        assert b.status()["slots"]["tiers"]["store"]["entries"] == 0  # sealed: nothing it can read
        assert ask(b.url, "alice", mine)["cache_n"] <= consumers(b)["shared_prefix_tokens"]
        assert not b.events("store.fetched")
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "c", CONSUMERS + sealed),
                 env=env_of(s3)) as c:
        wait_for(lambda: c.status()["slots"]["tiers"]["store"]["entries"] >= 1, 20, "c to list the bucket")
        again = ask(c.url, "alice", mine)
        assert again["cache_n"] >= 0.9 * (again["cache_n"] + again["prompt_n"]) and c.events("store.fetched")
    wrong = Wrapper(tmp_path, argv(server_bin, demo_path),
                    chat_yaml(tmp_path / "d", CONSUMERS + sealed.replace(str(key), str(other))), env=env_of(s3))
    code = wrong.wait(60)
    said = wrong.log_path.read_text()
    assert code != 0 and "is not the key" in said and "the-team-key" not in said, said[-2000:]

    # a new key (docs/consumers.md#a-new-key): sealed again; the old key is refused, the new one goes on with it
    new = tmp_path / "new-key"
    new.write_text("the-new-team-key-0123456789abcdef\n")
    config = tmp_path / "rekey.yaml"
    config.write_text(chat_yaml(tmp_path / "a", CONSUMERS + sealed))
    rekeyed = subprocess.run([sys.executable, "-m", "wrapper.cli", "slots", "rekey", "--config", str(config),
                              "--new-key", str(new)], capture_output=True, text=True, env={**os.environ, **s3.env()},
                             cwd=ROOT, timeout=300)
    assert rekeyed.returncode == 0 and json.loads(rekeyed.stdout)["entries"] >= 1, rekeyed.stdout + rekeyed.stderr
    old_key = Wrapper(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path / "e", CONSUMERS + sealed),
                      env=env_of(s3))
    assert old_key.wait(60) != 0 and "is not the key" in old_key.log_path.read_text()
    with running(tmp_path, argv(server_bin, demo_path),
                 chat_yaml(tmp_path / "f", CONSUMERS + sealed.replace(str(key), str(new))), env=env_of(s3)) as f:
        wait_for(lambda: f.status()["slots"]["tiers"]["store"]["entries"] >= 1, 20, "f to list the bucket")
        again = ask(f.url, "alice", mine)
        assert again["cache_n"] >= 0.9 * (again["cache_n"] + again["prompt_n"]) and f.events("store.fetched")


def test_a_request_the_server_places_itself_reuses_nothing_of_anothers(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Messages and Responses requests go to a slot llama-server chooses (by the longest common prefix): under
    isolation every free slot holding another consumer's conversation is kept and cut down to the public beginning
    before they go. Bob sends alice's conversation as Messages, the agent as Responses: neither reuses it."""
    secret = conversation("Alice's question about the ledger of 1914")
    system, user = secret[0]["content"], secret[1]["content"]
    with running(tmp_path, argv(server_bin, demo_path), team_yaml(tmp_path), env=ADMIN) as wrapper:
        ask(wrapper.url, "alice", secret)
        public = consumers(wrapper)["shared_prefix_tokens"]
        status, _, raw = http("POST", f"{wrapper.url}/v1/messages", {
            "model": "demo", "max_tokens": 1, "system": system, "messages": [{"role": "user", "content": user}]},
            timeout=600, headers={"Authorization": f"Bearer {KEYS['bob']}"})
        assert status == 200, raw[:300]
        usage = json.loads(raw)["usage"]
        assert usage["cache_read_input_tokens"] <= public < usage["input_tokens"], usage
        assert wrapper.events("consumers.cut")
        again = ask(wrapper.url, "alice", secret)  # hers was kept before the cut: restored
        assert again["cache_n"] >= 0.9 * (again["cache_n"] + again["prompt_n"]), again
        status, _, raw = http("POST", f"{wrapper.url}/v1/responses", {
            "model": "demo", "max_output_tokens": 1, "instructions": system, "input": user},
            timeout=600, headers={"Authorization": f"Bearer {KEYS['agent']}"})
        assert status == 200, raw[:300]
        usage = json.loads(raw)["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] <= public, usage


@pytest.mark.parametrize("parallel", [1, 2, 4])
def test_with_every_slot_holding_anothers_conversation_nothing_of_it_is_reused(
        tmp_path: Path, server_bin: str, demo_path: str, parallel: int) -> None:
    """examples/team.yaml at -np 1, 2 and 4 (one slot more: the lane): alice's conversations fill every slot; bob's
    copy of one of them takes a slot of hers (kept first, then cut) and reuses nothing past the system prompt, and
    hers comes back whole from the folder."""
    argv_np = [server_bin, "-m", demo_path, "-c", str(8192 * (parallel + 1)), "-np", str(parallel)]
    hers = [conversation(f"Alice's question number {n}") for n in range(parallel + 1)]
    with running(tmp_path, argv_np, team_yaml(tmp_path), env=ADMIN) as wrapper:
        for messages in hers:
            ask(wrapper.url, "alice", messages)
        public = consumers(wrapper)["shared_prefix_tokens"]
        copied = ask(wrapper.url, "bob", hers[0])
        assert copied["cache_n"] <= public, copied
        (cut,) = wrapper.events("consumers.cut")
        assert cut["of"] == "alice" and cut["for"] == "bob", cut
        back = ask(wrapper.url, "alice", hers[0])
        assert back["cache_n"] >= 0.9 * (back["cache_n"] + back["prompt_n"]), back


def test_right_after_a_restart_the_restored_slots_are_kept_apart_and_forgotten(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """A start restores what the slots held at the stop, before any request has told the wrapper how many slots
    there are: bob's first request, one the server places itself, reuses nothing of alice's restored conversation;
    and a forget that comes first clears her restored slot."""
    secret = conversation("Alice's question about the ledger of 1915")
    config = team_yaml(tmp_path)
    with running(tmp_path, argv(server_bin, demo_path), config, env=ADMIN) as wrapper:
        ask(wrapper.url, "alice", secret)
        assert wrapper.stop() == 0  # slots.save: hers is kept, and noted as what slot 0 held
    with running(tmp_path, argv(server_bin, demo_path), config, env=ADMIN) as wrapper:
        status, _, raw = http("POST", f"{wrapper.url}/v1/messages", {
            "model": "demo", "max_tokens": 1, "system": secret[0]["content"],
            "messages": [{"role": "user", "content": secret[1]["content"]}]},
            timeout=600, headers={"Authorization": f"Bearer {KEYS['bob']}"})
        assert status == 200, raw[:300]
        assert json.loads(raw)["usage"]["cache_read_input_tokens"] <= consumers(wrapper)["shared_prefix_tokens"]
        again = ask(wrapper.url, "alice", secret)  # hers comes back into a slot, and is noted there at the stop
        assert again["cache_n"] >= 0.9 * (again["cache_n"] + again["prompt_n"]), again
        assert wrapper.stop() == 0
    with running(tmp_path, argv(server_bin, demo_path), config, env=ADMIN) as wrapper:
        status, answer = delete(wrapper.url, {"Authorization": f"Bearer {KEYS['alice']}"})
        assert status == 200 and answer["slots"], answer  # her restored slot, cleared
        assert ask(wrapper.url, "alice", secret)["cache_n"] <= consumers(wrapper)["shared_prefix_tokens"]


# -- a front-end's users, a request's cache_salt -----------------------------------------------------------------

def ask_as(url: str, headers: dict[str, str], messages: list[dict[str, Any]],
           **more: Any) -> dict[str, Any]:
    """As `ask`, with any headers and body fields (a front-end's user, a cache_salt)."""
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": messages, "max_tokens": 1, "temperature": 0, **more}, timeout=600,
                          headers=headers)
    assert status == 200, raw[:300]
    timings = json.loads(raw)["timings"]
    return {"cache_n": timings["cache_n"], "prompt_n": timings["prompt_n"]}


def test_a_front_ends_users_and_a_requests_salt_reuse_only_their_own(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """examples/team.yaml as it is. Through Open WebUI's one key, user u2 sending u1's conversation reuses no more
    than the public beginning, and so does a request claiming u1's header without the key; u1's own next turn
    reuses it all, and the status names `open-webui/u1`. `cache_salt`: alice with another salt (or none) reuses no
    more than the public beginning, with her own all of it; the salt reaches neither llama-server nor the log. Each
    user lists what is kept for it (and nothing of the other's); the read-only token reads the status, not more."""
    user = {"Authorization": f"Bearer {FRONT_END_KEY}"}
    u1, u2 = {**user, "X-OpenWebUI-User-Id": "u1"}, {**user, "X-OpenWebUI-User-Id": "u2"}
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    theirs, hers = conversation("U1's question about the ledger of 1907"), conversation("Alice's salted question")
    reader = tmp_path / "read-token"
    reader.write_text("read-only-token-0123\n")
    config = team_yaml(tmp_path) + f"admin: {{read_token_file: {reader}}}\n"
    with running(tmp_path, argv(server_bin, demo_path), config, env=ADMIN) as wrapper:
        reading = {"Authorization": "Bearer read-only-token-0123"}  # Prometheus', a router's: reads, nothing else
        for path in ("/wrapper/status", "/metrics", "/v1/loads"):
            assert http("GET", wrapper.url + path, headers=reading)[0] == 200, path
            assert http("GET", wrapper.url + path, headers=alice)[0] == 401, path  # a consumer's key: not its business
        load = json.loads(http("GET", f"{wrapper.url}/v1/loads", headers=reading)[2])
        assert load["dp_rank_count"] == 1 and load["loads"][0]["max_total_num_tokens"] > 0, load
        assert http("POST", f"{wrapper.url}/wrapper/drain", headers=reading)[0] == 401
        assert http("DELETE", f"{wrapper.url}/wrapper/conversations?consumer=alice", headers=reading)[0] == 401
        rows = [("u1 asks", ask_as(wrapper.url, u1, theirs))]
        public = consumers(wrapper)["shared_prefix_tokens"]
        rows += [("u2 sends u1's", ask_as(wrapper.url, u2, theirs)),
                 ("no key, u1's header", ask_as(wrapper.url, {"X-OpenWebUI-User-Id": "u1"}, theirs)),
                 ("bob, u1's header", ask_as(wrapper.url, {"Authorization": f"Bearer {KEYS['bob']}",
                                                         "X-OpenWebUI-User-Id": "u1"}, theirs)),
                 ("u1 goes on", ask_as(wrapper.url, u1, theirs)),
                 ("alice, salt s1", ask_as(wrapper.url, alice, hers, cache_salt="s1-secret-salt")),
                 ("alice, salt s2", ask_as(wrapper.url, alice, hers, cache_salt="s2-secret-salt")),
                 ("alice, no salt", ask_as(wrapper.url, alice, hers)),
                 ("alice, salt s1 again", ask_as(wrapper.url, alice, hers, cache_salt="s1-secret-salt"))]
        print(f"\n{'request':<22} {'reused':>7} {'read':>6}   (public beginning {public})")
        for what, row in rows:
            print(f"{what:<22} {row['cache_n']:>7} {row['prompt_n']:>6}")
        for what, row in rows[1:4] + rows[6:8]:
            assert row["cache_n"] <= public, (what, row, public)
        for what, row in (rows[4], rows[8]):
            assert row["cache_n"] >= 0.9 * (row["cache_n"] + row["prompt_n"]), (what, row)
        by_name = consumers(wrapper)["by_name"]
        assert "open-webui/u1" in by_name and "open-webui/u2" in by_name, by_name
        assert not [name for name in by_name if "#" in name], by_name  # a salt's conversations are alice's
        classed = wrapper.events("request.classed")  # the log says who each request was, and how it was classed
        assert {(e["consumer"], e["salted"], e["class"]) for e in classed} >= {
            ("open-webui/u1", False, "interactive"), ("open-webui/u2", False, "interactive"),
            ("anonymous", False, "interactive"), ("alice", True, "interactive")}, classed
        def listed(headers: dict[str, str], query: str = "") -> dict[str, Any]:
            status, _, raw = http("GET", f"{wrapper.url}/wrapper/conversations{query}", headers=headers)
            assert status == 200, raw[:300]
            found: dict[str, Any] = json.loads(raw)
            return found

        own, other = listed(u1), listed(u2)  # each user's own view: its entries and slots, nobody else's
        assert (own["consumer"], other["consumer"]) == ("open-webui/u1", "open-webui/u2")
        assert own["entries"] or own["slots"], own
        assert not {e["key"] for e in own["entries"]} & {e["key"] for e in other["entries"]}, (own, other)
        assert not set(own["slots"]) & set(other["slots"]), (own, other)
        admin = listed({"Authorization": f"Bearer {TOKEN}"}, "?consumer=open-webui/u1")
        assert (admin["entries"], admin["slots"]) == (own["entries"], own["slots"])
        assert http("GET", f"{wrapper.url}/wrapper/conversations")[0] == 401  # no key: nobody's view
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions",
                              {"messages": theirs, "max_tokens": 1}, headers={**user, "X-OpenWebUI-User-Id": "a b"})
        assert status == 400 and b"X-OpenWebUI-User-Id" in raw, raw[:300]
        assert wrapper.stop() == 0
    assert "secret-salt" not in wrapper.log_path.read_text()


def test_a_forget_under_a_running_answer_keeps_nothing_of_it(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Alice forgets while her own long answer streams: the forget answers at once, naming the slot still in
    flight; her answer goes on to its end (her client loses nothing of it); then nothing of that conversation is
    kept — no entry (the checkpoints under the answer and at its end save nothing), the slot erased — and her same
    turn again reads her prompt anew. Bob's conversation, in the other slot, stays."""
    mine, bobs = conversation("Alice's long question"), conversation("Bob's question")
    with running(tmp_path, argv(server_bin, demo_path), chat_yaml(tmp_path, CONSUMERS), env=ADMIN) as w:
        ask(w.url, "bob", bobs)
        body = {"messages": mine, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(f"{w.url}/v1/chat/completions", data=json.dumps(body).encode(), headers={
            "Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            while b'"content"' not in response.readline():  # her answer is under way
                pass
            status, answer = delete(w.url, {"Authorization": f"Bearer {KEYS['alice']}"})
            assert status == 200 and answer["in_flight"], answer
            rest = response.read()
        print(f"\nforget under an answer: {answer}")
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in rest, rest[-300:]
        cleared = wait_for(lambda: [e for e in w.events("consumers.slots_cleared") if e.get("after") == "its request"],
                           30, "her slot to be erased once her answer ended")
        assert cleared[0]["consumer"] == "alice" and cleared[0]["slots"] == answer["in_flight"], cleared
        assert not kept_of(tmp_path / "slots", "alice")[0]
        assert ask(w.url, "alice", mine)["cache_n"] <= consumers(w)["shared_prefix_tokens"]
        assert ask(w.url, "bob", bobs)["cache_n"] > 700  # in its slot still
