"""`store.*` as a user writes them: bad URLs and endpoints fail at load with the key, credentials are never
echoed; a request to a hung store never keeps the process alive after it stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hooks.store.settings import SECRET, STORE
from hooks.store.threads import map_on
from wrapper.built_ins import parse as parse_config
from wrapper.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("store", "message"), [
    ("url: http://bucket/x", "not an s3:// URL"),
    ("url: s3://AK:SECRET1@bucket/x", "has no '@'"),
    ("url: s3://bucket/x?versionId=1", "has no '@', '?' or '#'"),
    ("{url: s3://b/x, endpoint: not a url}", "http://HOST[:PORT]"),
    ("{url: s3://b/x, endpoint: '127.0.0.1:9000'}", "http://HOST[:PORT]"),
    ("{url: s3://b/x, endpoint: 'http://AK:SECRET1@host:9000'}", "has no user:password@"),
])
def test_a_bad_store_fails_at_load_and_never_echoes_a_credential(store: str, message: str) -> None:
    text = f"store: {store}\n" if store.startswith("{") else f"store:\n  {store}\n"
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "c.yaml")
    assert message in str(caught.value) and "c.yaml" in str(caught.value)
    assert "SECRET1" not in str(caught.value)


def test_a_good_store_reads_and_hides_its_keys() -> None:
    config = parse_config("store: {url: s3://llm-kv/conv, endpoint: 'https://s3.example:9000', "
                          "secret_key: SECRET1}\n", "c.yaml")
    settings = STORE.of(config)
    assert settings.url == "s3://llm-kv/conv" and settings.endpoint == "https://s3.example:9000"
    assert settings.secret_key == "SECRET1" and SECRET.show(settings.secret_key) == "(set)"  # `check`


def test_a_hung_store_request_never_keeps_the_process_alive() -> None:
    script = f"""
import asyncio, sys, time
sys.path.insert(0, {str(ROOT)!r})
from hooks.store import threads
async def main():
    try:
        await asyncio.wait_for(threads.run(time.sleep, 60), timeout=0.2)
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
