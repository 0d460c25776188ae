"""What a person waits for behind an agent, with and without preemption, and what it costs the agent.

Two wrappers on the same model (`-np N`, slots save/restore, the conversation cache), one with
`priority.preempt: false` (the queue alone: the question waits for a slot) and one with preemption (the default).
Measured side by side in one run:
  alone      a one-line question's first token with nothing else running (median of 3), and an agent's
             greedy streamed answer of AGENT_TOKENS tokens
  behind     N agents stream (X-Priority: background); 2 s in, the question: its first token, without and with
             preemption
  the agent  how much later its answer ended than without preemption (against the question's own time), and
             whether its text is a lone uninterrupted run's (with -np 1 at temperature 0 it should be: its own state
             is restored; with more slots the agents are batched together, which changes the numbers)

With --kinds, the five kinds of agent people run (plain chat, offering tools, reasoning, the Responses and the
Messages API), on real chat templates (llama.cpp's own: Llama 3.1, a DeepSeek R1 distill), on the README's config
as it is (`examples/chat.yaml`, with `priority.preempt: true`: the lane is on, one slot more than -np kept for
people) and the agent marked as the README shows (`"service_tier": "flex"`, `X-Priority: background`): the
question's first token alone and beside each, against the bound (3x alone + 1 s), the prompt tokens it read,
whether the agent's text is its lone run's; with --busy, again with a CPU burner beside.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_priority.py [--model gemma] \
        [--parallel 2] [--kinds [--busy]]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.asking import KINDS, Asked, agent, person, prompt_n
from tests.helpers import Wrapper, chat_yaml

AGENT_TOKENS = 600
CONFIG = """
slots: {{dir: {dir}}}
priority: {{preempt: {preempt}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def first_token_alone(wrapper: Wrapper) -> float:
    times = []
    for _ in range(3):
        asked = person(wrapper.url).start().join()
        assert asked.status == 200 and asked.first_token is not None
        times.append(asked.first_token)
    return statistics.median(times)


def behind(wrapper: Wrapper, parallel: int) -> tuple[Asked, list[Asked]]:
    agents = [agent(wrapper.url, AGENT_TOKENS).start() for _ in range(parallel)]
    for asked in agents:
        asked.wait_tokens(1)
    time.sleep(2.0)
    question = person(wrapper.url).start().join()
    for asked in agents:
        asked.join()
        assert asked.status == 200 and asked.tokens == AGENT_TOKENS and asked.finals == 1, (asked.tokens, asked.finals)
    return question, agents


def kinds(server: str, model: str, tmp: Path, busy: bool) -> None:
    """The question beside each kind of agent people run, on the README's config (`examples/chat.yaml`, with
    `priority.preempt: true`: the lane is on, the slots sharing one KV) and the README's marks, `-np 1`; `busy`: a
    CPU burner beside (one process spinning: half of this 2-core machine; llama-server then runs `-t 1`: with two
    threads on the one free core they spin-wait for each other, 50 times slower, whatever is in front of it)."""
    print(f"\nthe agents people run, {Path(model).name}, the README's config and marks, -np 1, agents of "
          f"{AGENT_TOKENS // 2} tokens{', a CPU burner beside' if busy else ''}; the person's first token, median of "
          f"{TRIES}:")
    print(f"  {'agent':<10} {'alone':>8} {'beside':>8} {'bound':>8}        prompt read alone/beside  the agent's text")
    tmp.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])] if busy else []
    try:
        for kind in KINDS:
            template = ["--jinja", "--chat-template-file", models.template(server, kind.template)] \
                if kind.template else []
            threads = ["-t", "1"] if busy else []  # llama-server's threads spin-wait for each other: with the
            argv = [server, "-m", model, "-c", "8192", "-np", "1", *threads, *template]  # burner on one core, one
            wrapper = Wrapper(tmp, argv, chat_yaml(tmp / kind.name, "priority: {preempt: true}\n"))
            try:
                wrapper.wait_ready()
                alone, beside, read, same = [], [], [], []
                for _ in range(TRIES):
                    asked = person(wrapper.url).start().join()
                    assert asked.first_token is not None
                    alone.append(asked.first_token)
                    for _ in range(2):  # the second with its prompt from the slot, as the run beside the question
                        lone = kind.ask(wrapper.url, AGENT_TOKENS // 2).start().join()
                    working = kind.ask(wrapper.url, AGENT_TOKENS // 2).start()
                    working.wait_tokens(1)
                    time.sleep(2.0)
                    question = person(wrapper.url).start().join()
                    working.join()
                    assert question.first_token is not None and working.status == 200, working.raw[:300]
                    beside.append(question.first_token)
                    read.append(f"{prompt_n(asked)}/{prompt_n(question)}")
                    same.append(working.text == lone.text)
            finally:
                wrapper.kill()
            a, b = statistics.median(alone), statistics.median(beside)
            bound = 3 * a + 1
            text = "its lone run's" if all(same) else f"its lone run's {sum(same)} of {len(same)}"
            print(f"  {kind.name:<10} {a:>7.3f}s {b:>7.3f}s {bound:>7.2f}s {'met' if b <= bound else 'MISSED':>6}  "
                  f"{' '.join(read):<24}  {text}")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


TRIES = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["demo", "gemma"], default="demo")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--kinds", action="store_true", help="only the question beside each kind of agent")
    parser.add_argument("--busy", action="store_true", help="the kinds with a CPU burner beside, too")
    options = parser.parse_args()
    server = models.llama_server()
    model = models.gemma() if options.model == "gemma" else models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", str(options.parallel)]
    if options.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            for busy in (False, True) if options.busy else (False,):
                kinds(server, model, Path(tmp) / str(busy), busy)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        wrappers = {preempt: Wrapper(tmp_path, argv, CONFIG.format(dir=tmp_path / preempt, preempt=preempt))
                    for preempt in ("false", "true")}
        try:
            for wrapper in wrappers.values():
                wrapper.wait_ready()
            quiet, preempting = wrappers["false"], wrappers["true"]
            alone_q = first_token_alone(preempting)
            lone = agent(preempting.url, AGENT_TOKENS, headers={}).start().join()
            assert lone.took is not None
            waited, unpaused = behind(quiet, options.parallel)
            question, agents = behind(preempting, options.parallel)
            pauses = preempting.events("priority.paused")
            resumes = preempting.events("priority.resumed")
        finally:
            for wrapper in wrappers.values():
                wrapper.kill()
    assert waited.first_token is not None and question.first_token is not None and question.took is not None
    goal = 2 * alone_q + 0.5
    print(f"{Path(model).name}, -np {options.parallel}, agents of {AGENT_TOKENS} tokens (temperature 0):")
    print(f"  question alone:                 first token {alone_q:.3f} s")
    print(f"  behind the agents, no preempt:  {waited.first_token:.3f} s  "
          f"(x{waited.first_token / alone_q:.0f} of alone)")
    print(f"  behind the agents, preempting:  {question.first_token:.3f} s  (x{question.first_token / alone_q:.1f} "
          f"of alone; goal <= 2x alone + 0.5 s = {goal:.3f} s: {'met' if question.first_token <= goal else 'MISSED'})")
    held = ", ".join(f"{r['pause_s']:.2f}" for r in resumes)
    kept = ", ".join(str(p["tokens"]) for p in pauses)
    print(f"  pauses {len(pauses)}, each held {held} s; kept {kept} tokens")
    for n, (asked, before) in enumerate(zip(agents, unpaused, strict=True)):
        assert asked.took is not None and before.took is not None
        same = "the uninterrupted run's text" if asked.text == lone.text else "another text (batched with the " \
            "others: not comparable)" if options.parallel > 1 else "ANOTHER TEXT"
        print(f"  agent {n}: {asked.took:.2f} s against {before.took:.2f} s without preemption: "
              f"{asked.took - before.took:+.2f} s (the question took {question.took:.2f} s); {asked.tokens} tokens, "
              f"one final event; {same}")


if __name__ == "__main__":
    main()
