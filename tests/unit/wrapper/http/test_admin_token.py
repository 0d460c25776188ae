"""The admin token's life: where the wrapper and `reload` find it, a file made after the start, and what a refusal
says about where it looked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import child_argv, http, running
from wrapper import built_ins
from wrapper.configuration.auth import AdminToken, default_token_file, read_token


def test_the_token_comes_from_the_file_then_the_environment_then_the_default_file(tmp_path: Path) -> None:
    home = {"HOME": str(tmp_path)}
    default = default_token_file(home)
    assert default == tmp_path / ".config" / "llama-wrapper" / "admin-token"
    assert default_token_file({**home, "XDG_CONFIG_HOME": "/xdg"}) == Path("/xdg/llama-wrapper/admin-token")
    token, off = AdminToken(None, home).read()
    assert token is None and off is not None and str(default) in off and "LLAMA_WRAPPER_ADMIN_TOKEN" in off
    default.parent.mkdir(parents=True)
    default.write_text("from-default\n")
    assert AdminToken(None, home).read() == ("from-default", None)
    assert AdminToken(None, {**home, "LLAMA_WRAPPER_ADMIN_TOKEN": "from-env"}).read() == ("from-env", None)
    named = tmp_path / "named"
    token, off = AdminToken(named, {**home, "LLAMA_WRAPPER_ADMIN_TOKEN": "from-env"}).read()
    assert token is None and off is not None and "does not exist" in off  # a named file is never bypassed
    assert "LLAMA_WRAPPER_ADMIN_TOKEN is set but not used" in off  # and the refusal says the variable was not used
    assert AdminToken(named, home).unused_env == ""
    named.write_text("from-file\n")
    assert AdminToken(named, home).read() == ("from-file", None)


def test_a_token_file_made_after_the_start_turns_the_admin_endpoints_on(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    config = f"admin: {{token_file: {token_file}}}\n"
    with running(tmp_path, child_argv(), config, timeout=30) as wrapper:
        assert wrapper.events("admin.off")
        assert http("POST", f"{wrapper.url}/wrapper/drain", {"timeout": "1s"})[0] == 403
        token_file.write_text("made-later\n")
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/drain", {"timeout": "1s"})
        assert status == 401, raw  # on now: a request without the token is refused as unauthorized
        assert wrapper.events("admin.on")
        token_file.write_text("rotated\n")
        request_headers = {"Authorization": "Bearer rotated"}
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", {"no_such_field": 1}, headers=request_headers)
        assert status == 400 and "no_such_field" in json.loads(raw)["error"]["message"]


def _reload(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wrapper.cli", "reload", *args], capture_output=True, text=True,
                          check=False, env={"PATH": os.environ["PATH"], **env})


def test_reload_finds_the_token_the_way_the_wrapper_does(tmp_path: Path) -> None:
    """--config (or LLAMA_WRAPPER_CONFIG) and its admin.token_file, else the default file: the README's commands
    work without exporting anything."""
    token_file = tmp_path / "token"
    token_file.write_text("from-config\n")
    config = tmp_path / "chat.yaml"
    config.write_text(f"admin: {{token_file: {token_file}}}\nslots: {{dir: {tmp_path}}}\n")
    with running(tmp_path, child_argv(), config.read_text(), timeout=30) as wrapper:
        url = wrapper.url
        home = {"HOME": str(tmp_path / "home")}
        refused = _reload(["--url", url, "--ctx", "2048"], home)
        assert refused.returncode == 1 and "refused" in refused.stderr
        assert "looked in" in refused.stderr and "LLAMA_WRAPPER_ADMIN_TOKEN (not set)" in refused.stderr
        assert str(default_token_file(home)) in refused.stderr
        for args, env in ((["--config", str(config)], home), ([], {**home, "LLAMA_WRAPPER_CONFIG": str(config)})):
            done = _reload(["--url", url, "--ctx", "2048", *args], env)
            assert "wrong or missing admin token" not in done.stderr, done.stderr  # the child refuses the reload
        default = default_token_file(home)
        default.parent.mkdir(parents=True)
        default.write_text("from-config\n")
        done = _reload(["--url", url, "--ctx", "2048"], home)
        assert "wrong or missing admin token" not in done.stderr, done.stderr


def test_the_read_only_token_is_read_at_each_use_and_a_missing_file_is_a_warning(tmp_path: Path) -> None:
    """admin.read_token_file: the token Prometheus and routers read the status with; a file made after the start
    counts, a missing one is a warning (nothing reads with it until it exists), never an error."""
    reader = tmp_path / "read-token"
    config = built_ins.parse(f"admin: {{read_token_file: {reader}}}\n")
    assert config.read_token_file == reader and any("admin.read_token_file" in w for w in config.warnings)
    assert read_token(config.read_token_file) is None and read_token(None) is None
    reader.write_text("reads-only\n")
    assert read_token(config.read_token_file) == "reads-only"
