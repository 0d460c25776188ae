"""Conversations past one machine: wrappers with their own slot folders on one bucket of a real S3 server
(SeaweedFS, started and stopped here), against the real llama-server. A conversation moves between them, two
stopped at once are both brought back by a third, the bucket going away never fails a request, a drain uploads
what is pending."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

from tests.helpers import Wrapper, http, running, wait_for
from tests.integration.test_conversations import Chat, argv
from tests.s3server import S3Server

CONFIG = """
slots: {{dir: {dir}}}
store: {{url: {store}, refresh: 1s, timeout: 3s}}
priority: {{lane: false}}  # one slot per -np: these tests count what leaves it for the folder and the bucket
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def config(tmp_path: Path, name: str, s3: S3Server) -> str:
    return CONFIG.format(dir=tmp_path / name, store=s3.store("conversations"))


def tiers(wrapper: Wrapper) -> dict[str, Any]:
    found: dict[str, Any] = wrapper.status()["slots"]["tiers"]
    return found


def manifests(s3: S3Server) -> list[str]:
    listed = s3._client().list_objects_v2(Bucket=s3.bucket, Prefix="conversations/")
    return [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".json")]


def uploaded(wrapper: Wrapper) -> bool:
    store = tiers(wrapper)["store"]
    return bool(store["pending"] == 0 and store["state"] == "up")


def test_a_conversation_moves_between_wrappers_and_a_third_brings_back_two_stopped_at_once(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    x, y = Chat("X"), Chat("Y")
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "a", s3), env=s3.env()) as a, \
            running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "b", s3), env=s3.env()) as b:
        x.turn(a.url)
        y.turn(a.url)  # X leaves a's only slot: into a's folder, then the bucket
        wait_for(lambda: uploaded(a), 30, "a's upload")
        wait_for(lambda: tiers(b)["store"]["entries"] >= 1, 10, "b to see a's manifest")
        assert x.turn(b.url) >= 0.9  # X continues on b, from the bucket
        fetched = b.events("store.fetched")
        assert fetched and fetched[0]["bytes"] > 1 << 20
        assert [d["choice"] for d in b.status()["slots"]["conversations"]["decisions"]] == ["restore"]
        # both stopped at the same moment (a holds Y, b holds X): each stop uploads what only it holds
        codes: list[int] = []
        stops = [threading.Thread(target=lambda w=w: codes.append(w.stop())) for w in (a, b)]
        for stop in stops:
            stop.start()
        for stop in stops:
            stop.join()
        assert codes == [0, 0]
        for each in (a, b):
            (flushed,) = [e for e in each.events() if e.get("event") in ("store.flushed", "store.flush_incomplete")]
            assert flushed["event"] == "store.flushed" and flushed["left"] == 0, flushed
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "c", s3), env=s3.env()) as c:
        wait_for(lambda: tiers(c)["store"]["entries"] >= 2, 10, "c to see both")
        assert y.turn(c.url) >= 0.9
        assert x.turn(c.url) >= 0.9
        listing = tiers(c)
        assert listing["store"]["url"].startswith("s3://") and s3.secret_key not in json.dumps(c.status())
        assert s3.secret_key not in c.log_path.read_text()


def test_the_bucket_going_away_never_fails_a_request_and_the_uploads_resume(
        tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    chats = [Chat(name) for name in "ABCD"]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "a", s3), env=s3.env()) as wrapper:
        chats[0].turn(wrapper.url)
        s3.stop()  # SIGTERM: SeaweedFS takes a few seconds
        for chat in chats[1:]:
            chat.turn(wrapper.url)  # each pushes the one before out of the slot: saved here, not uploaded
        assert chats[0].turn(wrapper.url) >= 0.9  # from the folder, the bucket down
        wait_for(lambda: tiers(wrapper)["store"]["state"] == "down", 30, "the store to be seen down")
        assert tiers(wrapper)["store"]["pending"] >= 2
        assert len(wrapper.events("store.down")) == 1  # once per change, not once per try
        s3.start()
        chats[1].turn(wrapper.url)  # a commit wakes the uploads
        wait_for(lambda: uploaded(wrapper), 60, "the uploads to resume")
        assert wrapper.events("store.up")
        assert len(manifests(s3)) >= 3


def test_a_drain_uploads_everything_pending(tmp_path: Path, s3: S3Server, server_bin: str, demo_path: str) -> None:
    chats = [Chat(name) for name in "ABC"]
    token = "store-drain-token"
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "a", s3),
                 env={**s3.env(), "LLAMA_WRAPPER_ADMIN_TOKEN": token}) as wrapper:
        s3.stop()
        for chat in chats:
            chat.turn(wrapper.url)
        wait_for(lambda: tiers(wrapper)["store"]["state"] == "down", 30, "the store to be seen down")
        pending = tiers(wrapper)["store"]["pending"]
        assert pending == 2
        s3.start()  # the sync is backing off: the drain does not wait for it
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/drain", {"timeout": "30s"},
                              headers={"Authorization": f"Bearer {token}"}, timeout=120)
        assert status == 200, raw
        flush = tiers(wrapper)["flush"]
        assert flush["left"] == 0 and flush["uploaded"] == pending + 1, flush  # and what the slot held
        assert len(manifests(s3)) == 3


def test_a_crash_with_the_store_on_keeps_the_conversation(tmp_path: Path, server_bin: str, demo_path: str,
                                                           s3: S3Server) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, "a", s3), env=s3.env()) as wrapper:
        chat = Chat("crash", size=70)  # more than cache.checkpoint_tokens
        chat.turn(wrapper.url)
        wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the conversation kept while idle")
        wait_for(lambda: uploaded(wrapper), 30, "the checkpoint uploaded")
        pid = int(wrapper.status()["server"]["pid"])
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: wrapper.events("wrapper.server_back"), 120, "the server started again")
        assert chat.turn(wrapper.url) >= 0.9  # back from the folder, the bucket in step
        assert manifests(s3) and wrapper.stop() == 0
