"""Past one machine, behind the real router: three wrappers (one llama-server each, `--alias demo`) on one bucket of
a real S3 server (SeaweedFS), behind SMG with the recipe's policy (docs/recipes/router.md): consistent hashing on
the agents' session header. Six sessions turn after turn; one host is drained and stopped, another SIGKILLed;
every session's next turn is answered and takes at least 90 % of the conversation from the cache."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from tests.helpers import Wrapper, http, wait_for
from tests.router import FILLER, Router, Session, seen, skip_without_smg
from tests.s3server import S3Server

TOKEN = "router-drain-token"
CONFIG = """
slots: {{dir: {dir}}}
store: {{url: {store}, refresh: 1s, timeout: 3s}}
cache: {{checkpoint_tokens: 16}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


@pytest.fixture(autouse=True)
def _smg() -> None:
    skip_without_smg()


def host(tmp_path: Path, name: str, s3: S3Server, server_bin: str, demo_path: str) -> Wrapper:
    config = CONFIG.format(dir=tmp_path / name, store=s3.store("conversations"))
    return Wrapper(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "1", "--alias", "demo"], config,
                   env={**s3.env(), "LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN})


def kept(wrapper: Wrapper) -> bool:
    """Every conversation it served is in the bucket: nothing its slots hold that the cache does not keep (its two
    slots are checkpointed one after the other), nothing pending. (The book is told of a turn before its answer
    leaves the wrapper: a turn just answered is counted.)"""
    slots = wrapper.status()["slots"]
    store = slots["tiers"]["store"]
    return (slots["conversations"]["unkept_tokens"], store["pending"], store["state"]) == (0, 0, "up")


def view(host: Wrapper | None) -> dict[str, object] | None:
    """A host's view, for a failure's message: its bucket index, what its slots hold unkept, its last decisions."""
    if host is None:
        return None
    slots = host.status()["slots"]
    store, conv = slots["tiers"]["store"], slots["conversations"]
    return {"store": {k: store[k] for k in ("state", "entries", "pending", "errors", "looked_s_ago")},
            "unkept": conv["unkept_tokens"], "untracked": conv["untracked_slots"], "decided": conv["decisions"][-3:]}


def told(hosts: list[Wrapper | None], session: Session, *before: object) -> str:
    """What a failed turn's message says: the session, its last turn, what the host that answered it saw and
    decided, and what the caller adds (the whole logs are printed too, but a CI's report may keep only their ends;
    a text, which pytest does not shorten as it does an object's repr)."""
    return repr((session.name, session.turns[-1], view(hosts[session.turns[-1].host]), *before, session.turns))


def test_sessions_behind_the_router_survive_a_drained_and_a_killed_host(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    hosts: list[Wrapper | None] = [host(tmp_path, f"h{i}", s3, server_bin, demo_path) for i in range(3)]
    every = list(hosts)
    sessions = [Session(f"agent-{i}") for i in range(6)]
    try:
        for each in hosts:
            assert each is not None
            each.wait_ready()
        with Router(tmp_path, [h.url for h in hosts if h is not None], "consistent_hashing") as router:
            first = [s.turn(router, hosts).host for s in sessions]
            for session, was in zip(sessions, first, strict=True):  # a session stays where its KV is
                turn = session.turn(router, hosts)
                assert (turn.host, turn.source) == (was, "slot") or turn.source == "folder", session.turns
                assert turn.reused >= 0.9, session.turns

            # the busiest host is drained: /health says 503 at once, the router stops sending, then it stops
            drained = max(range(3), key=first.count)
            gone = hosts[drained]
            assert gone is not None
            status, _, raw = http("POST", f"{gone.url}/wrapper/drain", {"timeout": "30s"},
                                  headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
            assert status == 200, raw
            assert gone.health() == 503
            wait_for(lambda: gone.url not in router.healthy(), 30, "the router to leave the drained host")
            assert gone.stop() == 0
            hosts[drained] = None
            for session in sessions:
                turn = session.turn(router, hosts)
                assert turn.reused >= 0.9, told(hosts, session)
                if first[sessions.index(session)] == drained:
                    assert turn.source == "bucket", session.turns  # its KV came from the drained host's uploads

            # one of the two left is SIGKILLed once its conversations are kept: nothing of theirs is lost
            killed = next(i for i, h in enumerate(hosts) if h is not None and
                          any(s.turns[-1].host == i for s in sessions))
            victim = hosts[killed]
            assert victim is not None
            wait_for(lambda: kept(victim), 60, "the checkpoints to reach the bucket")
            last_seen = view(victim)  # told with a failure below
            victim.signal_group(signal.SIGKILL)
            victim.wait(30)
            hosts[killed] = None
            wait_for(lambda: victim.url not in router.healthy(), 30, "the router to leave the killed host")
            moved = [s for s in sessions if s.turns[-1].host == killed]
            for session in sessions:
                turn = session.turn(router, hosts)
                assert turn.reused >= 0.9, told(hosts, session, {"killed": killed, "its view": last_seen})
            assert moved and all(s.turns[-1].source in ("bucket", "folder") for s in moved), \
                [s.turns for s in moved]
            assert all(s.turns[-1].host not in (drained, killed) for s in sessions)
    except AssertionError:
        for i, each in enumerate(every):  # what each host decided, kept, fetched and restored
            assert each is not None
            print(f"--- h{i}: " + "\n".join(str(e) for e in each.events() if str(e.get("event", "")).startswith(
                ("conversations.", "store.", "slots.", "wrapper.drain", "state."))))
        raise
    finally:
        for each in hosts:
            if each is not None:
                each.kill()


def test_a_request_without_a_model_is_refused_by_the_router_and_the_alias_is_the_id(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    """What a router asks of a host: the model by name (SMG refuses a body without `model`), and that name is
    llama-server's `--alias` (without it, the GGUF's path)."""
    wrapper = host(tmp_path, "h0", s3, server_bin, demo_path)
    try:
        wrapper.wait_ready()
        with Router(tmp_path, [wrapper.url], "consistent_hashing") as router:
            status, raw = router.chat("s", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert status == 400 and b"model" in raw, raw[:300]
            status, _, raw = http("GET", f"{router.url}/v1/models")
            assert status == 200 and b'"demo"' in raw, raw[:300]
            status, raw = router.chat("s", {"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 2})
            assert status == 200, raw[:300]
    finally:
        wrapper.kill()


def test_the_router_reads_each_hosts_load_and_sends_a_new_conversation_where_the_kv_holds_less(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """SMG's load monitor polls every worker's `GET /v1/loads` (each second here) and its `least_load` policy
    sends a request to the worker whose expected wait is least: the KV's use it read there (`token_usage`), and 1,024
    tokens it adds for each request it sent since its last read — so each request here waits for a read after the
    one before. One host holds a long conversation: new conversations go to the other; then the other holds a
    longer one: they go back."""
    config = "slots: {{dir: {dir}}}\nhooks:\n  on_startup: [{{builtin: slots.restore}}]\n" \
             "  on_will_stop: [{{builtin: slots.save}}]\n"
    hosts = [Wrapper(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "2", "--alias", "demo"],
                     config.format(dir=tmp_path / f"h{i}")) for i in range(2)]
    try:
        for each in hosts:
            each.wait_ready()
        with Router(tmp_path, [h.url for h in hosts], "least_load", "--load-monitor-interval", "1",
                    log_level="debug") as router:

            def holds_more(heavy: Wrapper, light: Wrapper) -> bool:
                """SMG's monitor read, after the long conversation, that `heavy` holds more than `light`."""
                polled = router.polled()
                return polled.get(heavy.url, 0) > polled.get(light.url, 0) + 500

            running = threading.Thread(target=http, args=("POST", f"{hosts[0].url}/v1/chat/completions", {
                "max_tokens": 200, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": FILLER * 20}]}), kwargs={"timeout": 600})
            running.start()  # while it runs, its prompt counts (the book learns what it left once it ends)
            during = wait_for(lambda: next(
                (load for load in [json.loads(http("GET", f"{hosts[0].url}/v1/loads")[2])["loads"][0]]
                 if load["num_running_reqs"] == 1 and load["num_used_tokens"] > 300), None), 60,
                "a running request's prompt in /v1/loads", interval=0.05)
            running.join()
            assert during["token_usage"] > 0, during
            for heavy, size in ((0, 80), (1, 130)):  # ~1,500 tokens, then ~2,400: more than the first holds
                light = 1 - heavy
                long = {"model": "demo", "max_tokens": 8, "temperature": 0,
                        "messages": [{"role": "user", "content": FILLER * size + " Summarize."}]}
                status, _, raw = http("POST", f"{hosts[heavy].url}/v1/chat/completions", long, timeout=600)
                assert status == 200, raw[:300]
                load = json.loads(http("GET", f"{hosts[heavy].url}/v1/loads")[2])["loads"][0]
                assert load["num_used_tokens"] > 1000 and load["max_total_num_tokens"] == 4096, load
                wait_for(lambda: holds_more(hosts[heavy], hosts[light]), 30,  # noqa: B023 - used at once
                         f"SMG's load monitor to read h{heavy}'s /v1/loads", interval=0.2)
                went = []
                for i in range(3):
                    reads = router.reads()
                    wait_for(lambda: router.reads() >= reads + 2, 30,  # noqa: B023 - used at once
                             "SMG to read the loads after the last request", interval=0.2)
                    before = [seen(h).answered for h in hosts]
                    status, raw = router.chat(f"new-{heavy}-{i}", {
                        "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": f"Hello {i}"}]})
                    assert status == 200, raw[:300]
                    went += [j for j, h in enumerate(hosts) if seen(h).answered > before[j]]
                assert went == [light] * 3, (went, router.polled())
            status, _, raw = http("GET", f"{router.url}/get_loads")
            details = {d["worker"]: d for d in json.loads(raw)["loads"]}
            assert {d["max_total_num_tokens"] for d in details.values()} == {4096}, details  # SMG parsed them
    finally:
        for each in hosts:
            each.kill()
