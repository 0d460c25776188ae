"""llama-server's API keys as the wrapper reads and checks them, and secrets kept out of status and logs."""

from __future__ import annotations

from pathlib import Path

import pytest
from multidict import CIMultiDict

from wrapper import built_ins
from wrapper.asked import Class
from wrapper.configuration.auth import (
    REDACTED,
    admin_token,
    allowed,
    as_llama_server_reads,
    presented,
    redacted,
    server_keys,
)
from wrapper.configuration.consumers import ANONYMOUS, CONSUMERS, consumer_of
from wrapper.configuration.sections import PrioritySettings
from wrapper.queue.priority import classify


def test_keys_are_read_as_llama_server_reads_them(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# a comment\nfrom-file\n\nsecond\n")
    assert server_keys(["s", "--api-key", "a,b,,c"], {}) == ("a", "b", "c")
    assert server_keys(["s", "--api-key-file", str(key_file)], {}) == ("from-file", "second")
    assert server_keys(["s"], {"LLAMA_API_KEY": "env-key"}) == ("env-key",)
    assert server_keys(["s", "--api-key=x"], {"LLAMA_API_KEY": "env-key"}) == ("x",)
    assert server_keys(["s"], {}) == ()


def test_a_key_matches_only_itself() -> None:
    assert allowed(("a", "sesame"), "sesame") and allowed(("a", "sesame"), "a")
    assert not allowed(("sesame",), "sesam") and not allowed(("sesame",), "") and not allowed((), "x")


def test_secrets_are_redacted_in_every_spelling() -> None:
    argv = ["llama-server", "-m", "m.gguf", "--api-key", "k1", "--api-key=k2", "-hft", "t1", "--hf-token=t2",
            "--api-key-file", "/etc/keys"]
    shown = redacted(argv)
    assert not {"k1", "k2", "t1", "t2"} & {part.split("=")[-1] for part in shown}
    assert shown == ["llama-server", "-m", "m.gguf", "--api-key", REDACTED, f"--api-key={REDACTED}", "-hft",
                     REDACTED, f"--hf-token={REDACTED}", "--api-key-file", "/etc/keys"]


def test_an_admin_token_that_cannot_be_read_says_how_to_make_one(tmp_path: Path) -> None:
    for problem, prepare in (("does not exist", lambda f: None), ("is empty", lambda f: f.write_text("\n"))):
        token_file = tmp_path / "admin-token"
        token_file.unlink(missing_ok=True)
        prepare(token_file)
        with pytest.raises(ValueError, match=problem) as caught:
            admin_token(token_file, {})
        assert "make one with: " in str(caught.value) and "list index" not in str(caught.value)
    token_file.write_text("s3cret\n")
    assert admin_token(token_file, {}) == "s3cret"


# -- one reader of the key a request presents ---------------------------------------------------------------------

PRESENTED = [  # (headers, the key read)
    ({"Authorization": "Bearer sk-a"}, "sk-a"),
    ({"Authorization": "bearer sk-a"}, "sk-a"),  # the scheme in any case (RFC 9110)
    ({"Authorization": "BEARER   sk-a  "}, "sk-a"),
    ({"Authorization": "sk-a"}, "sk-a"),  # no scheme, as llama-server allows
    ({"X-Api-Key": "sk-a"}, "sk-a"),  # Anthropic's clients
    ({"x-api-key": " sk-a "}, "sk-a"),
    ({"Authorization": "Bearer sk-a", "X-Api-Key": "sk-b"}, "sk-a"),  # Authorization first, as llama-server reads
    ({"Authorization": "Bearer"}, ""),
    ({"Authorization": ""}, ""),
    ({}, ""),
]


@pytest.mark.parametrize(("headers", "key"), PRESENTED)
def test_every_form_of_presenting_a_key_is_read_alike_by_everything_a_key_decides(headers: dict[str, str],
                                                                                  key: str) -> None:
    """Consumers, background keys, llama-server's keys and the admin token read one key: before, a key sent
    without `Bearer` was a consumer but never a background key, and `bearer` in lower case was refused by the
    wrapper's own 401. aiohttp's headers are read in any case, as here."""
    given = CIMultiDict(headers)
    assert presented(given) == key
    consumers = CONSUMERS.of(built_ins.parse('consumers:\n  keys: {alice: ["sk-a"], bob: ["sk-b"]}\n'))
    assert consumer_of(given, consumers) == ("alice" if key == "sk-a" else ANONYMOUS)
    background = classify(given, {}, PrioritySettings(background_keys=("sk-a",)))
    assert background is (Class.BACKGROUND if key == "sk-a" else Class.INTERACTIVE)
    assert allowed(("sk-a",), presented(given)) is (key == "sk-a")  # llama-server's keys, the admin token


@pytest.mark.parametrize(("headers", "sent"), [
    ({"Authorization": "Bearer sk-a"}, None), ({"Authorization": "sk-a"}, None),  # llama-server reads both
    ({"X-Api-Key": "sk-a"}, None),
    ({"Authorization": "bearer sk-a"}, "Bearer sk-a"), ({"Authorization": " Bearer sk-a "}, "Bearer sk-a"),
    ({"Authorization": "Bearer"}, None), ({}, None),
])
def test_a_key_llama_server_would_not_read_is_passed_on_as_it_reads_one(headers: dict[str, str],
                                                                        sent: str | None) -> None:
    """llama-server takes `Bearer ` exactly: a key the wrapper read in another form goes on as `Bearer KEY`, so that
    llama-server's own --api-key check agrees with the wrapper's."""
    assert as_llama_server_reads(CIMultiDict(headers)) == sent
