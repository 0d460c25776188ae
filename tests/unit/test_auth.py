"""llama-server's API keys as the wrapper reads and checks them, and secrets kept out of status and logs."""

from __future__ import annotations

from pathlib import Path

from wrapper.auth import REDACTED, allowed, redacted, server_keys


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
