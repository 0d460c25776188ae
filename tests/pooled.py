"""Two real wrappers sharing one pool (`degrade.pool`), as the integration test and bench_pool use them: a main
model with a projector and a draft model (SmolLM2 drafts for itself) and a task model with a small context.
The pool is sized with `llama-wrapper plan --pool` so that the task's long request fits only if the main gives
up its projector and its draft."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import media
from tests.helpers import ROOT, Wrapper, http, wait_for

SMOLLM2_WIDTH = 576
MAIN_CONTEXT, TASK_CONTEXT, LONG_CONTEXT = 2048, 1024, 4096
LONG_NEEDS = 2560  # the context LONG needs: its ~2.2k tokens and the answer, in cells of 256
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
LONG = "A long report from the archive of the harbour office, to be summarised. " + STORY * 120  # ~2.2k tokens
CONFIG = """
slots: {{dir: {slots}}}
{media}degrade: {{pool: {pool}, budget: {total}, context: {context}, relax_after: {relax}, pool_wait: 60s{extra}}}
priority: {{lane: false}}  # one slot each, as `plan` sizes the shares: with the lane's slot a second conversation
                           # stays held, and the relax makes room for it (docs/pool.md)
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def config(slots: Path, pool: Path, total: int, context: int, relax: str = "10m", extra: str = "",
           media: bool = True) -> str:
    """`media`: the projector on demand (the main has one; the demo's task has none)."""
    return CONFIG.format(slots=slots, pool=pool, total=total, context=context, relax=relax, extra=extra,
                         media="media: {projector: on_demand}\n" if media else "")


def share_of(argv: list[str], context: int, projector: str = "always") -> int:
    """What a member with this command line takes at a start (`plan --pool`, a folder that is no pool)."""
    config = Path(f"/tmp/llama-wrapper-plan-{context}-{projector}.yaml")
    config.write_text(f"media: {{projector: {projector}}}\ndegrade: {{context: {context}}}\n")
    done = subprocess.run([sys.executable, "-m", "wrapper.cli", "plan", "--json", "--budget", "64GiB", "--config",
                           str(config), "--pool", "/nonexistent/pool", "--", *argv],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    return int(json.loads(done.stdout)["pool"]["new_member"]["share"])


@dataclass
class Pair:
    main: Wrapper
    task: Wrapper
    pool: Path
    total: int
    sums: list[int] = field(default_factory=list)  # the shares' sum, read from the records while running
    _stop: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        def read() -> None:
            while not self._stop.is_set():
                self.sums.append(records_sum(self.pool))
                time.sleep(0.05)
        threading.Thread(target=read, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for wrapper in (self.main, self.task):
            wrapper.kill()


def records(pool: Path) -> list[dict[str, Any]]:
    found = []
    for path in (pool / "members").glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # removed while read
    return found


def records_sum(pool: Path) -> int:
    return sum(int(r["share"]) for r in records(pool))


def argvs(server_bin: str, demo: str, projector: Path) -> tuple[list[str], list[str]]:
    main = [server_bin, "-m", demo, "--mmproj", str(projector), "-md", demo, "--spec-type", "draft-simple",
            "-np", "1"]
    return main, [server_bin, "-m", demo, "-np", "1"]


def sized_total(server_bin: str, demo: str, projector: Path) -> tuple[int, dict[str, int]]:
    """The pool's total: the main with its projector and draft, the task at rest, and a third of what the task's
    long request needs more: it fits only if the main gives up more than its projector."""
    main, task = argvs(server_bin, demo, projector)
    without_draft = [server_bin, "-m", demo, "--mmproj", str(projector), "-np", "1"]
    sizes = {"main": share_of(main, MAIN_CONTEXT), "main_without_draft": share_of(without_draft, MAIN_CONTEXT),
             "task": share_of(task, TASK_CONTEXT), "task_long": share_of(task, LONG_CONTEXT)}
    need = sizes["task_long"] - sizes["task"]
    assert sizes["main"] - sizes["main_without_draft"] > need, sizes  # the draft alone pays for the long request
    return sizes["main"] + sizes["task"] + need // 3, sizes


def start_pair(tmp: Path, server_bin: str, demo: str, projector: Path, relax: str = "3s") -> Pair:
    total, _ = sized_total(server_bin, demo, projector)
    pool = tmp / "pool"
    main_argv, task_argv = argvs(server_bin, demo, projector)
    main = Wrapper(tmp, main_argv, config(tmp / "slots-main", pool, total, MAIN_CONTEXT))
    main.wait_ready(180)
    task = Wrapper(tmp, task_argv, config(tmp / "slots-task", pool, total, TASK_CONTEXT, relax))
    task.wait_ready(180)
    return Pair(main, task, pool, total)


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int = 8) -> tuple[int, dict[str, Any]]:
    status, _, raw = http("POST", f"{url}/v1/chat/completions",
                          {"messages": messages, "max_tokens": max_tokens, "temperature": 0}, timeout=600)
    return status, json.loads(raw)


def argv_of(wrapper: Wrapper) -> list[str]:
    found: list[str] = wrapper.status()["server"]["argv"]
    return found


def load_projector(wrapper: Wrapper) -> None:
    status, answer = chat(wrapper.url, [media.image_message("What colour is this?", media.png())])
    assert status == 200, answer
    wait_for(lambda: "--mmproj" in argv_of(wrapper), 60, "the main's projector to load")


def memory(wrapper: Wrapper) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(http("GET", f"{wrapper.url}/wrapper/memory")[2])
    return found


def make_projector(directory: Path) -> Path:
    return media.make_projector(directory / "mmproj-test.gguf", SMOLLM2_WIDTH)
