"""Never lose a conversation under load: an agent's loop that leaves no quiet moment, a shared KV too small for every
conversation, another consumer's request — on the README's configs (examples/chat.yaml, examples/team.yaml as they
are), with the real llama-server and the demo model."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Wrapper, chat_yaml, http, running, wait_for
from tests.killing import content, server_pid, streamed

LOG = " ".join(f"Line {i}: the river carried stones of many colours past the mill." for i in range(150))
"""An agent's first turn reads a file: ~2.4k tokens with the demo model's template."""


class Agent:
    """An agent's loop: each turn is sent the moment the last answer ended (Claude Code, Codex and opencode do
    that), so the server is never quiet between them."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Work through the task step by step."},
            {"role": "user", "content": "Here is the build log:\n" + LOG}]

    def turn(self, max_tokens: int = 24) -> dict[str, Any]:
        status, _, raw = http("POST", f"{self.url}/v1/chat/completions",
                              {"messages": self.messages, "max_tokens": max_tokens, "temperature": 0}, timeout=600)
        assert status == 200, raw[:300]
        answer: dict[str, Any] = json.loads(raw)
        self.went_on(answer["choices"][0]["message"]["content"])
        return answer

    def went_on(self, said: str) -> None:
        self.messages.append({"role": "assistant", "content": said})
        self.messages.append({"role": "user", "content": f"Step {len(self.messages) // 2}: what does the log say "
                                                         "about the stones next?"})


def reused(timings: dict[str, Any]) -> float:
    return int(timings["cache_n"]) / (int(timings["cache_n"]) + int(timings["prompt_n"]))


def restarted(wrapper: Wrapper, pid: int) -> None:
    wait_for(lambda: wrapper.health() == 200 and wrapper.status()["server"]["pid"] != pid, 120,
             "llama-server started again")


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_an_agent_loop_killed_as_a_turn_ends_goes_on_from_its_checkpoint(
        tmp_path: Path, server_bin: str, demo_path: str, slots: int) -> None:
    """Turns back to back leave the checkpoints no quiet moment: the conversation is kept right after the answer that
    grew it, so llama-server SIGKILLed the moment the last answer ended costs the next turn only what the last turns
    added (reused ≥ 90 %), not the whole conversation (0 % before)."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", str(slots)],
                 chat_yaml(tmp_path)) as wrapper:
        agent = Agent(wrapper.url)
        for _ in range(3):
            agent.turn()
        pid = server_pid(wrapper)
        os.kill(pid, signal.SIGKILL)
        restarted(wrapper, pid)
        after = agent.turn()
        assert reused(after["timings"]) >= 0.9, after["timings"]
        assert [e for e in wrapper.events("conversations.checkpoint") if e.get("busy")]
        status = wrapper.status()["slots"]["conversations"]
        assert status["checkpoints"]["busy"] >= 1 and status["checkpoints"]["stall_s"] > 0, status["checkpoints"]


def test_an_agent_loop_killed_mid_stream_goes_on_from_its_checkpoint(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """A stream cut by a SIGKILL in the middle of a loop with no quiet moment is continued from the conversation as
    kept after an earlier turn: the new server reads again only what came since (the pause is the load, the
    restore and that prefill, measured in bench_crash), and the client gets one whole answer."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"], chat_yaml(tmp_path)) as wrapper:
        agent = Agent(wrapper.url)
        first = agent.turn()
        conversation = int(first["timings"]["prompt_n"]) + int(first["timings"]["cache_n"])
        agent.turn()

        def tenth_token(events: list[dict[str, Any]]) -> bool:
            return sum(1 for e in events if e.get("choices") and e["choices"][0]["delta"].get("content")) >= 10

        events = streamed(wrapper, {"messages": agent.messages, "max_tokens": 60, "temperature": 0,
                                    "ignore_eos": True}, tenth_token)
        finals = [e for e in events if e.get("choices") and e["choices"][0].get("finish_reason")]
        assert len(finals) == 1 and events[-1] == {"done": True}, events[-3:]
        timings = [e["timings"] for e in events if e.get("timings")][-1]
        assert int(timings["cache_n"]) >= 0.9 * conversation, (timings, conversation)
        assert len(content(events)) > 0


def conversations_in_turn(url: str, count: int, rounds: int) -> list[list[float]]:
    """`count` agents' conversations of ~2.9k tokens each, taken in turn for `rounds` rounds: what each turn reused."""
    agents = []
    for n in range(count):
        agent = Agent(url)
        agent.messages[1]["content"] = f"Agent {n}'s build log:\n" + " ".join(
            f"Line {i}: agent {n} saw stone {i * (n + 3)} pass the mill." for i in range(200))
        agents.append(agent)
    return [[reused(agent.turn(max_tokens=16)["timings"]) for agent in agents] for _ in range(rounds)]


def test_conversations_in_a_full_shared_kv_are_kept_not_purged(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Three conversations of ~2.9k tokens on `-np 2 -c 8192` (three slots with the lane, one KV of 8,192 cells):
    two fit, the third needs room. The wrapper makes it before each prompt (the least valuable slot kept, then
    erased) and restores each conversation at its turn: every turn of rounds 2-3 reuses ≥ 90 %, and llama-server never
    purges a slot itself (before: 0 % from round 2 on, `purging slot` in its log)."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"], chat_yaml(tmp_path)) as wrapper:
        rounds = conversations_in_turn(wrapper.url, 3, 3)
        assert all(r >= 0.9 for r in rounds[1] + rounds[2]), rounds
        purged = [e["line"] for e in wrapper.events("server.output") if "purging slot" in e.get("line", "")]
        assert not purged, purged
        assert wrapper.events("conversations.taken"), "no room was made"
        assert wrapper.status()["slots"]["conversations"]["purged"]["count"] == 0
