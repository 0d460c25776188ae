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

Then the agents people run, which the wrapper does not pause (they offer tools, reason, or speak the Responses or the
Messages API), on real chat templates (llama.cpp's own: Llama 3.1, a DeepSeek R1 distill), with the lane
(`priority.lane`: one slot more than -np, kept for interactive requests): the question's first token alone and
behind each, against the goal (3x alone + 1 s), and whether the agent's text is its lone run's.

    LLAMA_SERVER=$(llama.cpp/build-server) python tests/bench/bench_priority.py [--model gemma] [--parallel 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests import models
from tests.asking import Asked, agent, person
from tests.helpers import Wrapper

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


LANE_CONFIG = """
slots: {{dir: {dir}}}
priority: {{background_keys: ["agent-key"], lane: {lane}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
KEY = {"Authorization": "Bearer agent-key"}
KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {  # what the agent sends, and the template the server runs
    "chat offering tools": ("meta-llama-Llama-3.1-8B-Instruct", "/v1/chat/completions",
                            {"tools": TOOLS, "tool_choice": "auto"}),
    "reasoning (R1 distill)": ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "/v1/chat/completions", {}),
    "POST /v1/responses": ("meta-llama-Llama-3.1-8B-Instruct", "/v1/responses", {}),
    "POST /v1/messages": ("meta-llama-Llama-3.1-8B-Instruct", "/v1/messages", {"model": "demo"}),
}


def unpausable(server: str, model: str, tmp: Path) -> None:
    """The question behind each kind of agent the wrapper does not pause, with the lane and without it."""
    print(f"\nagents the wrapper does not pause, {Path(model).name}, -np 1, agents of {AGENT_TOKENS // 2} tokens:")
    print(f"  {'agent':<24} {'alone':>8} {'no lane':>10} {'lane':>8} {'goal':>8}  the agent's text")
    for kind, (template, path, extra) in KINDS.items():
        argv = [server, "-m", model, "-c", "8192", "-np", "1", "--jinja", "--chat-template-file",
                models.template(server, template)]
        timings: dict[str, float] = {}
        same = ""
        for lane in ("false", "auto"):
            wrapper = Wrapper(tmp, argv, LANE_CONFIG.format(dir=tmp / f"{kind}-{lane}".replace(" ", "_"), lane=lane))
            try:
                wrapper.wait_ready()
                timings["alone"] = min(timings.get("alone", 1e9), first_token_alone(wrapper))
                for _ in range(2):  # the second with its prompt from the slot, as the run beside the question
                    lone = agent(wrapper.url, AGENT_TOKENS // 2, headers=KEY, path=path, **extra).start().join()
                working = agent(wrapper.url, AGENT_TOKENS // 2, headers=KEY, path=path, **extra).start()
                working.wait_tokens(1)
                time.sleep(2.0)
                question = person(wrapper.url).start().join()
                working.join()
                assert question.first_token is not None and working.status == 200, (working.status, working.raw[:300])
                timings[lane] = question.first_token
                if lane == "auto":
                    same = "its lone run's" if working.text == lone.text else "ANOTHER TEXT"
            finally:
                wrapper.kill()
        goal = 3 * timings["alone"] + 1
        print(f"  {kind:<24} {timings['alone']:>7.3f}s {timings['false']:>9.3f}s {timings['auto']:>7.3f}s "
              f"{goal:>7.2f}s  {'met' if timings['auto'] <= goal else 'MISSED'}; {same}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["demo", "gemma"], default="demo")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--unpausable", action="store_true", help="only the agents the wrapper does not pause")
    options = parser.parse_args()
    server = models.llama_server()
    model = models.gemma() if options.model == "gemma" else models.demo()
    argv = [server, "-m", model, "-c", "8192", "-np", str(options.parallel)]
    if options.unpausable:
        with tempfile.TemporaryDirectory() as tmp:
            unpausable(server, model, Path(tmp))
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
    with tempfile.TemporaryDirectory() as tmp:
        unpausable(server, model, Path(tmp))


if __name__ == "__main__":
    main()
