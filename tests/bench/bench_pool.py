"""The proposal's example, measured: a main model (a projector and a draft) and a task model share one pool;
the task's long request is answered with what the main gives up, and the main gets it back once the task is
idle. Prints how much moved and how long each move took, side by side with the same long request on a task
that had the room from the start.

    python tests/bench/bench_pool.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models, pooled
from tests.helpers import Wrapper, wait_for


def main() -> None:
    server_bin, demo = models.llama_server(), models.demo()
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        projector = pooled.make_projector(tmp)
        pair = pooled.start_pair(tmp, server_bin, demo, projector)
        try:
            pooled.load_projector(pair.main)
            long_turn = [{"role": "user", "content": pooled.LONG}]
            began = time.monotonic()
            answers: dict[str, Any] = {}
            asking = threading.Thread(target=lambda: answers.update(task=pooled.chat(pair.task.url, long_turn)))
            asking.start()
            asking.join(600)
            answered = time.monotonic() - began
            status, _ = answers["task"]
            moves = pooled.memory(pair.task)["pool"]["moves"]
            moved = moves[-1] if moves else {"given": 0, "took_s": 0.0}
            print(f"task's long request: {status} in {answered:.2f} s")
            print(f"pool move: {moved['given'] / 2**20:.0f} MiB from main to task in {moved['took_s']:.2f} s")
            idle = time.monotonic()
            wait_for(lambda: pair.task.events("pool.back"), 120, "the task to give back")
            gave_back = time.monotonic()
            wait_for(lambda: "--mmproj" in pooled.argv_of(pair.main) and "-md" in pooled.argv_of(pair.main), 120,
                     "the main to climb back")
            back = time.monotonic()
            rung = pair.main.status()["degrade"]["rung"]
            print(f"pool give-back: main back to rung {rung} in {back - gave_back:.2f} s "
                  f"(the task gave back {gave_back - idle:.2f} s after its answer, degrade.relax_after 3s)")
            print(f"pool shares never above the total: {max(pair.sums or [0]) <= pair.total}")
        finally:
            pair.close()
        roomy = Wrapper(tmp, pooled.argvs(server_bin, demo, projector)[1])
        try:
            roomy.wait_ready(180)
            began = time.monotonic()
            status, _ = pooled.chat(roomy.url, [{"role": "user", "content": pooled.LONG}])
            alone = time.monotonic() - began
            print(f"the same request on a task with the room from the start: {status} in {alone:.2f} s "
                  f"(ratio {answered / alone:.1f}x)")
        finally:
            roomy.kill()


if __name__ == "__main__":
    main()
