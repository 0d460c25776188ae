"""The commands of the README and docs/, run as written (only the demo's port differs) in a fresh home against the
demo: what a newcomer types must work on a fresh clone."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import docs
from tests.helpers import running

ROOT = Path(__file__).resolve().parents[2]
README = docs.text()  # the README, then docs/
SH_BLOCKS: list[str] = re.findall(r"```sh\n(.*?)```", README, re.S)


def _block(marker: str) -> str:
    (block,) = {b for b in SH_BLOCKS if marker in b}  # one block (a page may show another's again)
    return block


def _env(home: Path, demo_path: str) -> dict[str, str]:
    """A newcomer's shell in the clone: a home of their own, the venv's llama-wrapper on the PATH, the pinned
    build and the demo model where build-server and get-model keep them (<cache>/models/<the demo>)."""
    return {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "LLAMA_WRAPPER_CACHE": str(Path(demo_path).parent.parent)}


def _sh(block: str, env: dict[str, str], port: int | None = None) -> subprocess.CompletedProcess[str]:
    if port is not None:
        block = block.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, check=False,
                          env=env, cwd=ROOT, timeout=600)


def _answers(text: str) -> list[Any]:
    """The JSON documents curl printed one after another."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        value, at = decoder.raw_decode(text, at)
        out.append(value)
    return out


def test_the_demo_curl_the_admin_token_and_the_reloads_run_as_written(tmp_path: Path, server_bin: str,
                                                                        demo_path: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home, demo_path)
    made = _sh(_block("secrets.token_urlsafe"), env)
    assert made.returncode == 0, made.stderr
    token_file = home / ".config" / "llama-wrapper" / "admin-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    demo = [server_bin, "-m", demo_path, "-c", "8192"]  # what `make demo` runs
    with running(tmp_path, demo, extra=["--config", "examples/hooks.yaml"], env=env) as wrapper:
        done = _sh(_block("Name three colours"), env, wrapper.port)
        assert done.returncode == 0, done.stderr
        (answer,) = _answers(done.stdout)
        assert answer["choices"][0]["message"]["content"].strip()
        done = _sh(_block("TOKEN=$(cat ~/.config/llama-wrapper/admin-token)\ncurl -s -X POST "
                          "http://127.0.0.1:8080/wrapper/reload"), env, wrapper.port)
        assert done.returncode == 0, done.stderr  # the reload CLI found the default token file by itself
        reloaded, end = json.JSONDecoder().raw_decode(done.stdout)  # curl's answer, then the CLI's lines
        assert reloaded["success"] and reloaded["n_ctx"] == 4096, reloaded
        assert "n_ctx 8192" in done.stdout[end:], done.stdout
        assert wrapper.status()["server"]["argv"][-2:] != ["-ctk", "q8_0"]


def test_the_budget_and_memory_curls_run_as_written_against_degrade_yaml(tmp_path: Path, server_bin: str,
                                                                          demo_path: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home, demo_path)
    assert _sh(_block("secrets.token_urlsafe"), env).returncode == 0
    with running(tmp_path, [server_bin, "-m", demo_path], extra=["--config", "examples/degrade.yaml"],
                 env=env) as wrapper:
        done = _sh(_block('{"budget": "2GiB"}'), env, wrapper.port)
        assert done.returncode == 0, done.stderr
        budget, memory = _answers(done.stdout)
        assert budget["success"] and budget["budget"] == 2 << 30, budget
        assert memory["budget"]["bytes"] == 2 << 30, memory


def test_the_plan_example_prints_what_the_readme_shows(tmp_path: Path, demo_path: str) -> None:
    """On a fresh clone: no llama-server on the PATH, nothing measured yet."""
    example = re.search(r"```\n\$ (llama-wrapper plan .*?)\n(.*?)```", README, re.S)
    assert example is not None
    command, shown = example.groups()
    home = tmp_path / "home"
    home.mkdir()
    done = _sh(command, _env(home, demo_path))
    assert done.returncode == 0, done.stderr
    paragraph = shown.split("\n\n", 1)[0]
    assert done.stdout.startswith(paragraph), done.stdout
    assert done.stdout.rstrip("\n") == shown.rstrip("\n")
    assert not any(home.rglob("*"))  # plan wrote nothing
