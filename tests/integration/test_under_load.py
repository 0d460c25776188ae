"""Never lose a conversation under load: an agent's loop that leaves no quiet moment, a shared KV too small for every
conversation, another consumer's request — on the README's configs (examples/chat.yaml, examples/team.yaml as they
are), with the real llama-server and the demo model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, Wrapper, chat_yaml, http, running, wait_for
from tests.killing import content, server_pid, streamed

LOG = " ".join(f"Line {i}: the river carried stones of many colours past the mill." for i in range(150))
"""An agent's first turn reads a file: ~2.4k tokens with the demo model's template."""


class Agent:
    """An agent's loop: each turn is sent the moment the last answer ended (Claude Code, Codex and opencode do
    that), so the server is never quiet between them; on chat completions, the Responses API (Codex) or the Messages
    API (Claude Code)."""

    def __init__(self, url: str, api: str = "chat") -> None:
        self.url, self.api = url, api
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Work through the task step by step."},
            {"role": "user", "content": "Here is the build log:\n" + LOG}]

    def turn(self, max_tokens: int = 24) -> dict[str, Any]:
        """One turn: the answer, with `reused` (the share of its prompt read from the slot) whatever its API."""
        system, rest = self.messages[0]["content"], self.messages[1:]
        path, body = {
            "chat": ("/v1/chat/completions", {"messages": self.messages, "max_tokens": max_tokens}),
            "messages": ("/v1/messages", {"model": "demo", "system": system, "messages": rest,
                                          "max_tokens": max_tokens}),
            "responses": ("/v1/responses", {"model": "demo", "instructions": system, "max_output_tokens": max_tokens,
                                            "input": [m if m["role"] == "user" else {
                                                "type": "message", "role": "assistant",
                                                "content": [{"type": "output_text", "text": m["content"]}]}
                                                for m in rest]}),
        }[self.api]
        status, _, raw = http("POST", f"{self.url}{path}", {**body, "temperature": 0}, timeout=600)
        assert status == 200, raw[:300]
        answer: dict[str, Any] = json.loads(raw)
        if self.api == "chat":
            said, answer["reused"] = answer["choices"][0]["message"]["content"], reused(answer["timings"])
        elif self.api == "messages":
            usage = answer["usage"]
            said = "".join(block.get("text", "") for block in answer["content"])
            answer["reused"] = usage["cache_read_input_tokens"] / (usage["cache_read_input_tokens"]
                                                                   + usage["input_tokens"])
        else:
            usage = answer["usage"]
            said = "".join(part.get("text", "") for item in answer["output"] for part in item.get("content", []))
            answer["reused"] = usage["input_tokens_details"]["cached_tokens"] / usage["input_tokens"]
        self.went_on(said)
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


def conversations_in_turn(url: str, count: int, rounds: int, api: str = "chat") -> list[list[float]]:
    """`count` agents' conversations of ~3.7k tokens each, taken in turn for `rounds` rounds: what each turn reused."""
    agents = []
    for n in range(count):
        agent = Agent(url, api)
        agent.messages[1]["content"] = f"Agent {n}'s build log:\n" + " ".join(
            f"Line {i}: agent {n} saw stone {i * (n + 3)} pass the mill." for i in range(200))
        agents.append(agent)
    return [[float(agent.turn(max_tokens=16)["reused"]) for agent in agents] for _ in range(rounds)]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_conversations_in_a_full_shared_kv_are_kept_not_purged(
        tmp_path: Path, server_bin: str, demo_path: str, api: str) -> None:
    """Three conversations of ~3.7k tokens on `-np 2 -c 8192` (three slots with the lane, one KV of 8,192 cells):
    two fit, the third needs room. The wrapper makes it before each prompt (the least valuable slot kept, then
    erased) and restores each conversation at its turn: every turn of rounds 2-3 reuses ≥ 90 %, and llama-server never
    purges a slot itself (before: 0 % from round 2 on, `purging slot` in its log). On the Messages and Responses APIs
    too: their prompts are told as llama-server makes them (hooks/conversations/prompts.py), Responses pinned by its
    `id_slot`, Messages prepared in the slot the server's own rule gives it."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"], chat_yaml(tmp_path)) as wrapper:
        rounds = conversations_in_turn(wrapper.url, 3, 3, api)
        assert all(r >= 0.9 for r in rounds[1] + rounds[2]), rounds
        purged = [e["line"] for e in wrapper.events("server.output") if "purging slot" in e.get("line", "")]
        assert not purged, purged
        assert wrapper.events("conversations.taken"), "no room was made"
        assert wrapper.status()["slots"]["conversations"]["purged"]["count"] == 0


TEAM = {name: f"sk-{name}-key" for name in ("alice", "bob", "ci-agent", "carol", "dave", "erin")}
PUBLIC = "You are the team assistant. Answer briefly."  # examples/team.yaml's shared_prefix


def team_yaml(tmp_path: Path) -> str:
    """examples/team.yaml as it is, its three keys given and three more consumers beside them."""
    text = (ROOT / "examples" / "team.yaml").read_text()
    for name in ("alice", "bob"):
        text = text.replace(f"change-me-{name}-key", TEAM[name])
    text = text.replace("change-me-agent-key", TEAM["ci-agent"])
    more = "".join(f'    {name}: ["{TEAM[name]}"]\n' for name in ("carol", "dave", "erin"))
    text = text.replace(f'    ci-agent: ["{TEAM["ci-agent"]}"]\n', f'    ci-agent: ["{TEAM["ci-agent"]}"]\n{more}')
    assert text.count("sk-") == 7 and f'content: "{PUBLIC}"' in text
    return text.replace("~/.cache/llama-wrapper/slots", str(tmp_path / "slots"))


def asked(url: str, who: str, api: str, messages: list[dict[str, Any]]) -> float:
    """One turn of `messages` as `who` on chat or Messages: the share of its prompt read from the cache."""
    if api == "chat":
        body: dict[str, Any] = {"messages": messages}
        path, headers = "/v1/chat/completions", {"Authorization": f"Bearer {TEAM[who]}"}
    else:
        body = {"model": "demo", "system": messages[0]["content"], "messages": messages[1:]}
        path, headers = "/v1/messages", {"X-Api-Key": TEAM[who]}
    status, _, raw = http("POST", f"{url}{path}", {**body, "max_tokens": 4, "temperature": 0}, timeout=600,
                          headers=headers)
    assert status == 200, raw[:300]
    answer: dict[str, Any] = json.loads(raw)
    if api == "chat":
        return reused(answer["timings"])
    read, rest = int(answer["usage"]["cache_read_input_tokens"]), int(answer["usage"]["input_tokens"])
    return read / (read + rest)


def test_six_consumers_probing_each_other_lose_no_owner_anything(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """examples/team.yaml's shape with six consumers on `-np 2`: alice's conversation sits in a slot; the others send
    hers (chat and Messages) and their own (Messages: placed by the server, which used to cut her slot without
    keeping it). Each probe reuses no more than the public beginning; alice's own next turn reuses ≥ 90 % — after
    the probes, after a restart, after another consumer's forget — on chat and on Messages."""
    env = {"LLAMA_WRAPPER_ADMIN_TOKEN": "team-admin-token"}
    argv = [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"]
    hers = [{"role": "system", "content": PUBLIC}, {"role": "user", "content": "Alice's log:\n" + LOG}]
    public_share = 0.05  # the public beginning is ~20 of ~2.4k tokens
    config = team_yaml(tmp_path)
    with running(tmp_path, argv, config, env=env) as wrapper:
        assert asked(wrapper.url, "alice", "chat", hers) < public_share
        for who, api in (("bob", "chat"), ("carol", "messages"), ("dave", "messages")):  # once each: a probe
            assert asked(wrapper.url, who, api, hers) < public_share, (who, api)  # leaves the prober its own copy
        for who in ("erin", "ci-agent"):
            own = [{"role": "system", "content": PUBLIC},
                   {"role": "user", "content": f"{who}'s notes:\n" + LOG.replace("stones", f"{who}'s stones")}]
            asked(wrapper.url, who, "messages", own)
        assert asked(wrapper.url, "alice", "chat", hers) >= 0.9
        assert asked(wrapper.url, "alice", "messages", hers) >= 0.9
        cut = [e for e in wrapper.events("consumers.cut") if e.get("of") == "alice"]
        saved = [e for e in wrapper.events("conversations.saved") if e.get("consumer") == "alice"]
        assert not cut or saved, (cut, saved)
        wrapper.stop()
    with running(tmp_path, argv, config, env=env) as wrapper:
        assert asked(wrapper.url, "alice", "messages", hers) >= 0.9
        assert asked(wrapper.url, "erin", "messages", hers) < public_share
        status, _, raw = http("DELETE", f"{wrapper.url}/wrapper/conversations",
                              headers={"Authorization": f"Bearer {TEAM['erin']}"})
        assert status == 200, raw
        assert asked(wrapper.url, "alice", "chat", hers) >= 0.9
        assert asked(wrapper.url, "ci-agent", "chat", hers) < public_share


def test_nobodys_conversations_are_not_restored_into_slots_under_isolation(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Conversations kept before `consumers:` was set are nobody's: no lookup under isolation may use them. A start
    with examples/team.yaml on the folder examples/chat.yaml filled leaves them in the store (`slots ls` says so) and
    its slots free, so the consumers do not take slots from each other (the README's try: 0, 0, 28 — not 0, 15, 15)."""
    argv = [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"]
    with running(tmp_path, argv, chat_yaml(tmp_path)) as wrapper:
        for n in range(3):
            http("POST", f"{wrapper.url}/v1/chat/completions", {"messages": [
                {"role": "user", "content": f"Question {n}: " + LOG[:1500]}], "max_tokens": 4}, timeout=600)
        assert wrapper.stop() == 0
    env = {"LLAMA_WRAPPER_ADMIN_TOKEN": "team-admin-token"}
    config = team_yaml(tmp_path)
    with running(tmp_path, argv, config, env=env) as wrapper:
        skipped = [e for e in wrapper.events("slots.restore_skipped") if "nobody's" in e.get("reason", "")]
        assert len(skipped) == 3, wrapper.events("slots.restore_skipped")
        ask = [{"role": "system", "content": PUBLIC}, {"role": "user", "content": "Draft my resignation letter."}]
        cached = []
        for who in ("alice", "bob", "alice"):
            status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", {"messages": ask, "max_tokens": 1},
                                  headers={"Authorization": f"Bearer {TEAM[who]}"}, timeout=600)
            assert status == 200, raw
            cached.append(json.loads(raw)["timings"]["cache_n"])
        assert cached[0] == 0 and cached[1] == 0 and cached[2] > 20, cached
        config_path = tmp_path / "team.yaml"
        config_path.write_text(config)
        listed = subprocess.run([sys.executable, "-m", "wrapper.cli", "slots", "ls", "--config", str(config_path),
                                 "--json"], capture_output=True, text=True, cwd=ROOT, check=True)
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert sum(1 for row in rows if row.get("nobodys")) >= 3, rows


def test_an_idle_kept_conversation_leaves_the_shared_kv_while_another_decodes(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """`-np 1` with the lane: two slots on one KV, and a decode's attention spans both slots' cells (16 tokens took
    650 ms beside an idle 1.4k-token slot, 450 ms beside an empty one). A conversation kept in the store and idle is
    erased while the other decodes (its restore costs milliseconds), and comes back whole at its next turn."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "1"], chat_yaml(tmp_path)) as wrapper:
        first, second = Agent(wrapper.url), Agent(wrapper.url)
        second.messages[1]["content"] = "Here is another log:\n" + LOG.replace("stones", "fish")
        first.turn()
        second.turn()
        compacted = wait_for(lambda: [e for e in wrapper.events("conversations.taken")
                                      if "idle beside a decoding slot" in e.get("why", "")], 30, "a compaction")
        assert compacted[0]["kept"] == 0, compacted
        assert first.turn()["reused"] >= 0.9
        assert second.turn()["reused"] >= 0.9


STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def nearly_full(wrapper: Wrapper) -> tuple[list[dict[str, Any]], str]:
    """On `-c 8192`: a long conversation (~7.8k tokens, answered) and a short one (its first turn: 200 tokens), with
    fewer than 300 cells to spare; the long one's messages and the short one's answer."""
    def tokens(messages: list[dict[str, Any]]) -> int:
        prompt = json.loads(http("POST", f"{wrapper.url}/apply-template", {"messages": messages})[2])["prompt"]
        said = http("POST", f"{wrapper.url}/tokenize", {"content": prompt, "add_special": True,
                                                       "parse_special": True})[2]
        return len(json.loads(said)["tokens"])

    def lines(n: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "".join(f"Line {i:04d}: the river carried stones of many colours "
                                                    "past the mill. " for i in range(n))}]

    per_line = (tokens(lines(200)) - tokens(lines(100))) / 100
    target = 8192 - 240 - 120  # the short conversation's ~240 cells and a little to spare
    long_one = lines(100 + int((target - tokens(lines(100))) / per_line))
    assert abs(tokens(long_one) - target) < 60, tokens(long_one)
    chat_answer(wrapper.url, long_one, 1)
    return long_one, chat_answer(wrapper.url, STORY, 200)


def no_purge_and_room_made(wrapper: Wrapper) -> None:
    purged = [e["line"] for e in wrapper.events("server.output") if "purging slot" in e.get("line", "")]
    assert not purged, purged
    assert [e for e in wrapper.events("conversations.taken") if "room in the shared KV" in e.get("why", "")]
    assert wrapper.status()["slots"]["conversations"]["purged"]["count"] == 0


def test_a_conversation_going_on_in_its_slot_makes_room_for_what_it_adds(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """`-np 2 -c 8192` nearly full (a long conversation and a short one): the short one's next turn goes on in its
    slot (no lookup, no restore: the fast path) and grows by its new message and its answer past the free cells. The
    wrapper counts that turn's prompt and makes room (the long one kept, then erased) before llama-server has to
    purge; both go on whole. No checkpoints here: one would keep the long conversation, and an idle kept one leaves
    the KV beside a decode anyway (the compaction above) — the room this turn makes is for what is not kept."""
    more = "cache: {checkpoint_tokens: 100000}\n"
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"], chat_yaml(tmp_path, more)) \
            as wrapper:
        long_one, first = nearly_full(wrapper)
        turn = [*STORY, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
        assert reused(answered(wrapper.url, turn, 200)["timings"]) >= 0.9
        no_purge_and_room_made(wrapper)
        assert reused(answered(wrapper.url, long_one, 1)["timings"]) >= 0.9  # back from the store


def test_a_start_that_restored_a_nearly_full_kv_makes_room_for_the_next_turn(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """The same two conversations kept at a stop and restored at the next start (8,064 of 8,192 cells): llama-server's
    `/slots` shows no tokens in a slot no task has run in, though a restore filled it, so room was judged from it and
    the short one's next turn made llama-server purge the long one (as a new user saw after a start that restored
    8,098 tokens). What such a slot holds is the book's: room is made first, and both go on whole."""
    argv = [server_bin, "-m", demo_path, "-c", "8192", "-np", "2"]
    with running(tmp_path, argv, chat_yaml(tmp_path)) as wrapper:
        long_one, first = nearly_full(wrapper)
        assert wrapper.stop() == 0  # both kept at the stop
    with running(tmp_path, argv, chat_yaml(tmp_path)) as wrapper:
        restored = wrapper.events("slots.restored")
        assert sum(e["tokens"] for e in restored) > 8192 - 300, restored
        turn = [*STORY, {"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
        assert reused(answered(wrapper.url, turn, 200)["timings"]) >= 0.9
        no_purge_and_room_made(wrapper)
        assert reused(answered(wrapper.url, long_one, 1)["timings"]) >= 0.9  # back from the store


def answered(url: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    status, _, raw = http("POST", f"{url}/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens,
                                                                 "temperature": 0, "ignore_eos": True}, timeout=600)
    assert status == 200, raw[:300]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def chat_answer(url: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
    return str(answered(url, messages, max_tokens)["choices"][0]["message"]["content"])
