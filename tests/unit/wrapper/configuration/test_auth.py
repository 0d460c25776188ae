"""llama-server's API keys as the wrapper reads and checks them, and secrets kept out of status and logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from wrapper.configuration.auth import REDACTED, admin_token, allowed, redacted, server_keys


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
