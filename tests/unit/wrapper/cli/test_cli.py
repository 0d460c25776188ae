"""The command line as a newcomer types it: strict options before `--`, the reload CLI finding its token, check's
warnings, exit codes as the README gives them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.helpers import child_argv


def cli(args: Sequence[str], env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wrapper.cli", *args], capture_output=True, text=True,
                          check=False, env=env, cwd=cwd)


def test_a_misspelt_run_option_is_refused_with_a_suggestion(tmp_path: Path) -> None:
    marker = tmp_path / "spawned"
    done = cli(["run", "--lisen", "127.0.0.1:8120", "--", "touch", str(marker)])
    assert done.returncode == 2 and not marker.exists()
    assert "No such option '--lisen'" in done.stderr and "Did you mean '--listen'?" in done.stderr
    assert "not an executable" not in done.stderr


@pytest.mark.parametrize("args", [
    ["--slots-dir", "--", "touch", "{marker}", "-m", "m.gguf"],
    ["--listen", "--", "touch", "{marker}"],
    ["--config", "--slots-dir", "x", "--", "touch", "{marker}"],
    ["--slots-dir"],
])
def test_an_option_never_takes_the_double_dash_as_its_value(tmp_path: Path, args: list[str]) -> None:
    marker = tmp_path / "spawned"
    done = cli(["run", *[a.format(marker=marker) for a in args]], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "needs a value" in done.stderr and "before the `--`" in done.stderr
    assert not marker.exists() and not (tmp_path / "--").exists()


def test_options_given_properly_still_run_the_server_command(tmp_path: Path) -> None:
    """`--listen=HOST:PORT`, values after their options, and a command without `--`: parsed as before."""
    done = cli(["run", "--listen=nowhere", "--slots-dir", str(tmp_path), "--", "true"])
    assert done.returncode == 2 and "--listen: write HOST:PORT" in done.stderr  # the value reached --listen
    done = cli(["run", "--listen", "127.0.0.1:1", "no-such-llama-server", "-m", "x"])
    assert done.returncode == 2 and "'no-such-llama-server' is not an executable" in done.stderr


def test_check_warns_about_what_would_fail_only_when_it_runs(tmp_path: Path) -> None:
    """A missing admin.token_file, a missing or non-executable hook script, an exec not on PATH: exit 0 with a
    warning each (the file may be made later), where `run` would have failed with exit 3 "Permission denied"."""
    script = tmp_path / "notify.sh"
    script.write_text("#!/bin/sh\necho hi\n")  # not chmod +x
    ok = tmp_path / "ok.sh"
    ok.write_text("#!/bin/sh\n")
    ok.chmod(0o755)
    config = tmp_path / "c.yaml"
    config.write_text(f"admin: {{token_file: {tmp_path / 'token'}}}\nhooks:\n  on_startup:\n"
                      f"    - shell: {script} --now\n    - shell: {tmp_path / 'gone.sh'}\n"
                      "    - exec: [no-such-program-here]\n"
                      f"    - shell: echo {{{{ model.name }}}}\n    - exec: [{ok}]\n    - shell: {ok} x\n")
    done = cli(["check", str(config)])
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 4, warnings
    assert f"c.yaml:1: admin.token_file: {tmp_path / 'token'} does not exist" in warnings[0]
    assert "make one with" in warnings[0]
    assert f"c.yaml:4: hooks.on_startup[0]: {script} is not executable" in warnings[1]
    assert f"chmod +x {script}" in warnings[1]
    assert f"{tmp_path / 'gone.sh'} does not exist" in warnings[2]
    assert "'no-such-program-here' is not on PATH" in warnings[3]


def test_slots_inspect_of_a_missing_file_is_exit_1_as_documented(tmp_path: Path) -> None:
    done = cli(["slots", "inspect", str(tmp_path / "slot0-x.bin")])
    assert done.returncode == 1 and "no such slot file" in done.stderr


def test_a_taken_port_says_to_choose_another_listen(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = cli(["run", "--listen", f"127.0.0.1:{port}", "--log-format", "json", "--", *child_argv()])
    assert done.returncode == 3, done.stderr
    (failed,) = [json.loads(line) for line in done.stderr.splitlines() if '"wrapper.listen_failed"' in line]
    assert failed["level"] == "error" and "choose another --listen" in failed["hint"]
    assert f"127.0.0.1:{port} is taken" in failed["hint"]


def test_a_model_that_is_not_gguf_is_exit_2_before_spawning(tmp_path: Path) -> None:
    page = tmp_path / "model.gguf"
    page.write_text("<!doctype html><title>Download</title>")
    marker = tmp_path / "spawned"
    done = cli(["run", "--", "touch", str(marker), "-m", str(page)])
    assert done.returncode == 2 and not marker.exists()
    assert "is not a GGUF file" in done.stderr and "<!do" in done.stderr


def test_a_home_that_cannot_be_written_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    """A service user without a home: the caches are skipped with a warning; the slot folder is the error."""
    not_a_folder = tmp_path / "home"
    not_a_folder.write_text("")
    env = {"PATH": os.environ["PATH"], "HOME": str(not_a_folder)}
    config = Path(__file__).resolve().parents[4] / "examples" / "chat.yaml"
    done = cli(["run", "--log-format", "json", "--config", str(config), "--", *child_argv()], env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "slots.dir: cannot create" in done.stderr
