"""`slots.store*` as a user writes them: bad URLs and endpoints fail at load with the key, credentials are never
echoed; a request to a hung store never keeps the process alive after it stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hooks.slots.settings import SECRET, SLOTS
from hooks.store.threads import map_on
from wrapper.config import ConfigError
from wrapper.extensions import parse as parse_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("slots", "message"), [
    ("store: http://bucket/x", "not an s3:// URL"),
    ("store: s3://AK:SECRET1@bucket/x", "has no '@'"),
    ("store: s3://bucket/x?versionId=1", "has no '@', '?' or '#'"),
    ("{store: s3://b/x, store_endpoint: not a url}", "http://HOST[:PORT]"),
    ("{store: s3://b/x, store_endpoint: '127.0.0.1:9000'}", "http://HOST[:PORT]"),
    ("{store: s3://b/x, store_endpoint: 'http://AK:SECRET1@host:9000'}", "has no user:password@"),
])
def test_a_bad_store_fails_at_load_and_never_echoes_a_credential(slots: str, message: str) -> None:
    text = f"slots: {slots}\n" if slots.startswith("{") else f"slots:\n  {slots}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml")
    assert message in str(caught.value) and "c.yaml" in str(caught.value)
    assert "SECRET1" not in str(caught.value)


def test_a_good_store_reads_and_hides_its_keys() -> None:
    config = parse_config("slots: {store: s3://llm-kv/conv, store_endpoint: 'https://s3.example:9000', "
                          "store_secret_key: SECRET1}\n", "c.yaml")
    settings = SLOTS.of(config)
    assert settings.store == "s3://llm-kv/conv" and settings.store_endpoint == "https://s3.example:9000"
    assert settings.store_secret_key == "SECRET1" and SECRET.show(settings.store_secret_key) == "(set)"  # `check`


def test_a_hung_store_request_never_keeps_the_process_alive() -> None:
    script = f"""
import asyncio, sys, time
sys.path.insert(0, {str(ROOT)!r})
from hooks.store import threads as daemons
async def main():
    try:
        await asyncio.wait_for(daemons.run(time.sleep, 60), timeout=0.2)
    except TimeoutError:
        print("given up", flush=True)
asyncio.run(main())
"""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.strip() == "given up" and time.monotonic() - began < 10


def test_map_on_keeps_order_and_raises_the_first_error() -> None:
    assert map_on(3, lambda n: n * n, range(10)) == [n * n for n in range(10)]

    def fails(n: int) -> int:
        if n == 4:
            raise ValueError("four")
        return n
    with pytest.raises(ValueError, match="four"):
        map_on(2, fails, range(8))
