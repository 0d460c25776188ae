"""A swap away and back under the real llama-swap: what the wrapper as each model's `cmd` saves a conversation.

The recipe's config (examples/llama-swap.yaml: `chat` the demo model, `task` Gemma 3 270M, examples/chat.yaml),
three ways, one after another in one run, with the same conversation of ~3.2k tokens on `chat` (plain llama-server
with `-np 2` and no `-kvu` gives a slot half of `-c 8192`):
  wrapper        the recipe: a turn on chat, then ROUNDS times a turn on task and the next turn on chat
  plain          the same config with plain llama-server as each `cmd` (`--port ${PORT}`, the same arguments)
  never swapped  the recipe, but chat's next turns come with no turn on task between: its slot never left
For each, the time of chat's next turn as the client sees it (through llama-swap: the swap back, the start, the
restore or the prefill, and the answer; the median of the rounds), how much of its prompt came from the cache,
and the turn on task (the swap away: chat's stop and save, task's start).

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_swap.py [--rounds 3] [--size 175]
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models, swap
from tests.swap import Conversation, LlamaSwap

STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "


def plain(settings: dict[str, Any]) -> dict[str, Any]:
    """Each cmd as llama-swap's README has it: llama-server itself on ${PORT}, with the same arguments."""
    changed = copy.deepcopy(settings)
    for model in changed["models"].values():
        server_args = re.split(r"\s--\s", model["cmd"], maxsplit=1)[1].strip()
        model["cmd"] = server_args.replace("${llama-server}", "${llama-server} --port ${PORT}", 1)
    return changed


def run(name: str, binary: str, settings: dict[str, Any], size: int, rounds: int, away: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder, LlamaSwap(Path(folder), binary, settings) as ls:
        chat, task = Conversation(ls, "chat"), Conversation(ls, "task")
        chat.turn("Remember this ledger. " + STORY * size)
        for n in range(rounds):
            if away:
                task.turn(f"Say hello, number {n + 1}.")
            chat.turn(f"Who wrote name number {n + 1}?")
        saves = [e["stop_s"] for e in ls.events("wrapper.stopped")]
        # chat's wrapper started again for each next turn: how long its start took (llama-server's load and the
        # restore), and the restore itself
        starts = [e["start_s"] for e in ls.events("wrapper.ready") if e["listen"] == ls.wrapper_url("chat")][1:]
        restores = [e["total_ms"] for e in ls.events("slots.restored")]
        return {"name": name, "first": chat.seconds[0], "prompt": chat.answers[0]["usage"]["prompt_tokens"],
                "back": statistics.median(chat.seconds[1:]), "reused": statistics.median(chat.reused[1:]),
                "cached": [a["timings"]["cache_n"] for a in chat.answers[1:]],
                "total": [a["timings"]["cache_n"] + a["timings"]["prompt_n"] for a in chat.answers[1:]],
                "away": statistics.median(task.seconds) if task.seconds else None,
                "stop": statistics.median(saves) if saves else None,
                "start": statistics.median(starts) if starts else None,
                "restore": statistics.median(restores) if restores else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=175, help="the first turn: STORY times this (175: ~3.2k tokens)")
    options = parser.parse_args()
    binary = swap.find_binary()
    settings = swap.config(models.llama_server(), models.demo(), models.gemma())
    rows = [run("wrapper", binary, settings, options.size, options.rounds, away=True),
            run("plain llama-server", binary, plain(settings), options.size, options.rounds, away=True),
            run("never swapped", binary, settings, options.size, options.rounds, away=False)]
    wrapped = rows[0]["back"]
    print(f"chat's next turn after a turn on task, through llama-swap ({Path(binary).parent.name}), a "
          f"{rows[0]['prompt']:,}-token conversation, median of {options.rounds}:")
    print(f"{'cmd':<20} {'first turn s':>12} {'turn on task s':>14} {'next turn s':>11} {'reused':>16} "
          f"{'wrapper / this':>14}")
    for row in rows:
        reused = f"{row['cached'][-1]:,}/{row['total'][-1]:,} {row['reused']:.2f}"
        away = f"{row['away']:.2f}" if row["away"] is not None else "-"
        print(f"{row['name']:<20} {row['first']:>12.2f} {away:>14} {row['back']:>11.2f} {reused:>16} "
              f"{wrapped / row['back']:>14.2f}")
    row = rows[0]
    if row["stop"] is not None and row["start"] is not None and row["restore"] is not None:
        print(f"the wrapper's stops (its save at each swap, wrapper.stopped stop_s): {row['stop']:.2f} s; chat's "
              f"start for the next turn (llama-server's load and the restore, wrapper.ready start_s): "
              f"{row['start']:.2f} s, the restore {row['restore']:.0f} ms (medians)")


if __name__ == "__main__":
    main()
