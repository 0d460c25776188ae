"""The command line as a newcomer types it: strict options before `--`, the reload CLI finding its token, check's
warnings, exit codes as the README gives them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest


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
