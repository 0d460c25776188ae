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
from wrapper.configuration.config import ConfigError

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


@pytest.mark.parametrize("value", ["12345", "[a, b]", "{x: 1}", "1.5", "true"])
def test_a_secret_of_the_wrong_type_is_refused_without_its_value(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"store:\n  secret_key: {value}\n", "c.yaml")
    message = str(caught.value)
    assert "c.yaml:2: store.secret_key must be a string" in message and "quote it" in message
    assert value not in message and "12345" not in message


def test_a_quoted_secret_of_digits_is_read() -> None:
    assert STORE.of(parse_config('store: {access_key: "12345"}\n', "c.yaml")).access_key == "12345"


def test_the_store_section_written_as_its_old_value_says_how_to_write_it() -> None:
    with pytest.raises(ConfigError, match=r"c.yaml:1: store is a section, not a value: write it as store: "
                                          r"\{url: s3://BUCKET/PREFIX\}"):
        parse_config("store: s3://bkt/p\n", "c.yaml")


@pytest.mark.parametrize("key", ["refresh", "timeout"])
def test_a_refresh_or_timeout_of_nothing_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"c.yaml:1: store.{key} must be more than 0s"):
        parse_config(f"store: {{{key}: 0s}}\n", "c.yaml")
