"""The commands of the README and docs/, run as written (only the demo's port differs) in a fresh home against the
demo: what a newcomer types must work on a fresh clone."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests import docs, s3server
from tests.demo import long_request as demo_long
from tests.helpers import free_port, http, port_free, running, wait_for

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


class _Try:
    """A `make demo-*` target run as the README says, in its own session (Ctrl-C: SIGINT to the group)."""

    def __init__(self, target: str, env: dict[str, str], port: int, log: Path, *more: str) -> None:
        self.log = log.open("wb")
        self.proc = subprocess.Popen(["make", "-s", target, f"LISTEN=127.0.0.1:{port}", *more], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.path = log

    def wait_ready(self, *ports: int) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.path.read_text()[-3000:]
            return all(_healthy(port) for port in ports)
        wait_for(ready, 300, f"{ports} to serve", interval=0.5)

    def stop(self) -> bool:
        """Ctrl-C as a terminal sends it (to the whole group: make and what it runs); True when what make ran
        exited cleanly (make itself dies of the SIGINT)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        code = self.proc.wait(120)
        self.log.close()
        said = self.path.read_text(errors="replace")
        return code in (0, -signal.SIGINT) and ('"exit_status": 0' in said or "Ctrl-C stops it" in said) \
            and "Traceback" not in said


def _healthy(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
    except OSError:
        return False


def _status(port: int) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(http("GET", f"http://127.0.0.1:{port}/wrapper/status")[2])
    return found


def _try_env(tmp_path: Path, demo_path: str) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return {**_env(home, demo_path), "MAKEFLAGS": ""}


def test_images_on_demand_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo-media", env, port, tmp_path / "demo.log")
    try:
        demo.wait_ready(port)
        assert "--mmproj" not in _status(port)["server"]["argv"]  # on demand: not loaded yet
        done = _sh(_block("tests.demo image"), env, port)
        assert done.returncode == 0, done.stderr
        answer, end = json.JSONDecoder().raw_decode(done.stdout)
        assert answer["choices"][0]["message"]["content"], answer
        assert "'loaded': True" in done.stdout[end:] and "'loads': 1" in done.stdout[end:], done.stdout[end:]
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_the_draft_only_while_alone_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo-spec", env, port, tmp_path / "demo.log")
    try:
        demo.wait_ready(port)
        assert _status(port)["spec"]["running"] is True
        started = time.monotonic()
        done = _sh(_block("Tell a long story"), env, port)
        assert done.returncode == 0, done.stderr
        print(done.stdout, f"the try took {time.monotonic() - started:.1f} s")
        # two streams of 600 tokens (ignore_eos: a sampled story may end early) decode together for longer than
        # spec.calm (10 s): the draft goes off
        wait_for(lambda: _status(port)["spec"]["running"] is False, 120, "the draft to be switched off", 0.5)
        assert "--spec-type" not in _status(port)["server"]["argv"]
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_a_pool_of_two_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    while not port_free(port + 1):
        port = free_port()
    demo = _Try("demo-pool", {**env, "TMPDIR": str(tmp_path)}, port, tmp_path / "demo.log")
    try:
        demo.wait_ready(port, port + 1)
        block = _block("tests.demo long").replace("127.0.0.1:8081", f"127.0.0.1:{port + 1}")
        done = _sh(block, env, port)
        assert done.returncode == 0, done.stderr
        answer, end = json.JSONDecoder().raw_decode(done.stdout)
        assert answer["choices"][0]["message"]["content"], answer
        moves = ast.literal_eval(done.stdout[end:].strip())
        assert moves and moves[-1]["given"] > 0, done.stdout[end:]  # the main gave the task what it asked
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_the_llama_swap_demo_as_written(tmp_path: Path, demo_path: str, llama_swap_bin: str) -> None:
    """`make demo-swap` (the real llama-swap with examples/llama-swap.yaml) and the recipe's commands: chat swapped
    out by a turn on task, then back with its conversation."""
    env, port = _try_env(tmp_path, demo_path), free_port()
    while not (port_free(port + 1) and port_free(port + 2)):  # the models' wrappers: startPort is PORT+1
        port = free_port()
    demo = _Try("demo-swap", {**env, "LLAMA_SWAP": llama_swap_bin, "TMPDIR": str(tmp_path)}, port,
                tmp_path / "demo.log")
    try:
        demo.wait_ready(port)
        done = _sh(_block('print("reused"'), env, port)
        assert done.returncode == 0, done.stderr
        running, reused = done.stdout.splitlines()
        assert running == "['task']", done.stdout
        words = reused.split()
        assert words[0] == "reused" and int(words[1]) >= 0.9 * int(words[3]), done.stdout
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]
    assert '"event": "wrapper.stopped"' in demo.path.read_text()  # llama-swap's Ctrl-C stopped chat, saved
    assert not list(tmp_path.glob("llama-wrapper-demo-swap-*"))  # its temp folder gone with it


def test_the_object_store_try_as_written(tmp_path: Path, demo_path: str) -> None:
    s3server.skip_without_weed()
    env, port = _try_env(tmp_path, demo_path), free_port()
    store = _Try("s3", env, port, tmp_path / "s3.log")
    demo = None
    try:
        wait_for(lambda: b"Ctrl-C stops it" in (tmp_path / "s3.log").read_bytes(), 120, "make s3 to serve", 0.5)
        demo = _Try("demo-store", env, port, tmp_path / "demo.log")
        demo.wait_ready(port)
        status, _, raw = http("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json.loads(demo_long()))
        assert status == 200, raw
        assert demo.stop(), demo.path.read_text()[-3000:]
        probe, listed, removed = (_sh(line, env) for line in _block("check --probe").splitlines())
        assert probe.returncode == 0 and "probe: 'ok: listed" in probe.stdout, probe.stdout + probe.stderr
        assert listed.returncode == 0 and " both " in listed.stdout, listed.stdout + listed.stderr
        assert removed.returncode == 0
        again = _sh(_block("check --probe").splitlines()[1], env)  # a fresh host: the bucket's alone
        assert " store " in again.stdout and " local " not in again.stdout, again.stdout
    finally:
        if demo is not None:
            demo.stop()
        assert store.stop(), store.path.read_text()[-3000:]


def test_the_crash_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo", env, port, tmp_path / "demo.log")
    try:
        demo.wait_ready(port)
        killed = _status(port)["server"]["pid"]
        done = _sh(_block("kill -KILL"), env, port)
        assert done.returncode == 0, done.stderr
        ended, restarts = done.stdout.splitlines()
        assert ended == "1" and "'count': 1" in restarts and "killed by SIGKILL" in restarts, done.stdout
        assert _status(port)["server"]["pid"] != killed
        assert '"error"' not in Path("/tmp/story.txt").read_text()
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_the_person_first_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo", env, port, tmp_path / "demo.log", "ARGS=-np 1")
    try:
        demo.wait_ready(port)
        started = time.monotonic()
        done = _sh(_block("X-Priority: $mark"), env, port)
        assert done.returncode == 0, done.stderr
        marked, unmarked = done.stdout.splitlines()
        assert marked.startswith("agents background: the person's first byte after "), done.stdout
        assert unmarked.startswith("agents interactive: the person's first byte after "), done.stdout
        # not a timing bound: unmarked, the person's request waits for a slot until a 600-token answer ends (ignore_eos:
        # it cannot end sooner), marked it is served in the lane beside them — the try's claim, one run measuring both
        waited = [float(line.rsplit(" ", 1)[1].rstrip("s")) for line in (marked, unmarked)]
        assert waited[0] < waited[1], done.stdout
        print(done.stdout, f"the try took {time.monotonic() - started:.1f} s")
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_the_sleep_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo", env, port, tmp_path / "demo.log")
    try:
        demo.wait_ready(port)
        done = _sh(_block("/wrapper/sleep"), env, port)
        assert done.returncode == 0, done.stderr
        slept, health, counts = done.stdout.splitlines()
        assert json.loads(slept)["asleep"] is True and json.loads(health)["sleep"] == "asleep", done.stdout
        assert counts.startswith("1 1 "), done.stdout
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]


def test_the_each_consumers_own_try_as_written(tmp_path: Path, demo_path: str) -> None:
    env, port = _try_env(tmp_path, demo_path), free_port()
    demo = _Try("demo", env, port, tmp_path / "demo.log", "CONFIG=examples/team.yaml")
    try:
        demo.wait_ready(port)
        done = _sh(_block("change-me-$who-key"), env, port)
        assert done.returncode == 0, done.stderr
        alice, bob, again, forgot, u1, u2, u1_again = done.stdout.splitlines()
        assert (int(alice), int(bob)) == (0, 0) and int(again) > 20, done.stdout
        again_too = _sh(_block("change-me-$who-key"), env, port)  # a reader trying it twice: the same numbers
        assert again_too.returncode == 0 and [line for line in again_too.stdout.splitlines() if line[0] != "{"] == \
            [alice, bob, again, u1, u2, u1_again], (done.stdout, again_too.stdout)
        answer = json.loads(forgot)
        assert answer["consumer"] == "alice" and answer["slots"], answer
        # a front-end's users (one key, the user in its header): the same as two consumers of their own
        assert (int(u1), int(u2)) == (0, 0) and int(u1_again) == int(again), done.stdout
        print(done.stdout)
    finally:
        assert demo.stop(), demo.path.read_text()[-3000:]
