"""A person never waits behind an agent, against the real llama-server and the demo model: a background generation
is paused for an interactive question (its slot kept in the conversation cache), resumed from its own state once
a slot is free, and its client gets one whole answer — at temperature 0 with `-np 1`, the uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests import models
from tests.asking import KINDS, TOOLS, Asked, Kind, agent, person, prompt_n
from tests.helpers import Wrapper, chat_yaml, http, running, wait_for

CONFIG = """
slots: {{dir: {dir}}}
priority: {{background_keys: ["agent-key"], lane: {lane}{more}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
TOKEN = "priority-token"


def config(tmp_path: Path, more: str = "", sections: str = "", lane: str = "false") -> str:
    """The slot built-ins and the background key; without a lane unless asked (these tests pause the agent)."""
    return CONFIG.format(dir=tmp_path / "slots", more=more, lane=lane) + sections


def argv(server_bin: str, demo_path: str, parallel: int = 1) -> list[str]:
    return [server_bin, "-m", demo_path, "-c", "8192", "-np", str(parallel)]


def paused(wrapper: Wrapper) -> list[dict[str, Any]]:
    return wrapper.events("priority.paused")


def behind(wrapper: Wrapper, background: list[Asked], question: Asked | None = None,
           check: Callable[[], object] | None = None) -> Asked:
    """Start the background requests, then (once each streams, or is under way, and `check` passed) the question;
    wait for all."""
    for asked in background:
        asked.start()
    for asked in background:
        if asked.body.get("stream"):
            asked.wait_tokens(40)
    if not all(a.body.get("stream") for a in background):
        wait_for(lambda: sum(decoded(s) >= 40 for s in json.loads(http("GET", f"{wrapper.url}/slots")[2]))
                 >= len(background), 120, "the background answers 40 tokens in")
    if check is not None:
        check()
    question = (question or person(wrapper.url)).start().join()
    for asked in background:
        asked.join()
    return question


def decoded(slot: dict[str, Any]) -> int:
    """The tokens a slot's generation under way has decoded (llama-server's GET /slots)."""
    return int((slot.get("next_token") or [{}])[0].get("n_decoded") or 0) if slot.get("is_processing") else 0


def whole(asked: Asked, tokens: int) -> None:
    """One answer of the tokens it asked for: nothing lost, nothing shown twice, one final event."""
    assert asked.status == 200, asked.raw[-600:]
    if asked.answer is not None:
        usage = asked.answer.get("usage") or {}
        assert usage.get("completion_tokens", asked.answer.get("tokens_predicted")) == tokens
        return
    assert asked.finals == 1 and asked.tokens == tokens, (asked.finals, asked.tokens)
    if "choices" in (asked.events[0] if asked.events else {}):
        assert asked.events[-1] == {"done": True}
        roles = [e for e in asked.events if (e.get("choices") or [{}])[0].get("delta", {}).get("role")]
        assert len(roles) == 1  # one answer: the resume's own role chunk is not shown
        assert len({e["id"] for e in asked.events if "id" in e}) == 1  # one answer's id throughout
        usages = [e["usage"] for e in asked.events if e.get("usage")]
        assert all(u["completion_tokens"] == tokens for u in usages), usages  # the whole answer's count
    else:
        (last,) = [e for e in asked.events if e.get("stop")]
        assert last["tokens_predicted"] == tokens and last["prompt"] == asked.body["prompt"]


@pytest.mark.parametrize(("stream", "path", "headers", "extra"), [
    (True, "/v1/chat/completions", {"X-Priority": "background"}, {}),
    (False, "/v1/chat/completions", {}, {"service_tier": "flex"}),
    (True, "/completion", {"Authorization": "Bearer agent-key"}, {}),
    (False, "/completion", {"Authorization": "Bearer agent-key"}, {}),
], ids=["chat-stream-header", "chat-json-service-tier", "completion-stream-key", "completion-json-key"])
def test_a_question_behind_an_agent_is_answered_and_the_agents_answer_is_unchanged(
        tmp_path: Path, server_bin: str, demo_path: str, stream: bool, path: str, headers: dict[str, str],
        extra: dict[str, Any]) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        usage = {"stream_options": {"include_usage": True}} if stream and "chat" in path else {}
        alone = agent(wrapper.url, 300, stream, headers={}, path=path, **usage).start().join()
        background = agent(wrapper.url, 300, stream, headers=headers, path=path, **extra, **usage)
        question = behind(wrapper, [background])
        assert question.status == 200 and question.text
        assert question.ended_at is not None and background.ended_at is not None
        assert question.ended_at < background.ended_at  # answered while the agent waited
        whole(background, 300)
        assert background.text == alone.text  # restored, not prefilled: the uninterrupted run's text
        (pause,) = paused(wrapper)
        assert pause["tokens"] > pause["generated"] > 0 and pause["slot"] == 0
        (resumed,) = wrapper.events("priority.resumed")
        assert resumed["pause_s"] > 0
        assert wrapper.events("conversations.restored")  # its own state came back
        status = wrapper.status()["priority"]
        assert status["preempt"] is True and status["running"] == [] and status["waiting"] == []
        assert wrapper.stop() == 0


def test_two_agents_with_two_slots_and_two_people_at_once(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path, 2), config(tmp_path)) as wrapper:
        agents = [agent(wrapper.url, 300) for _ in range(2)]
        for asked in agents:
            asked.start()
        for asked in agents:
            asked.wait_tokens(40)
        people = [person(wrapper.url, q) for q in ("What is the capital of France?", "Name a colour.")]
        for asked in people:
            asked.start()
        for asked in people:
            asked.join()
        for asked in agents:
            asked.join()
        assert all(p.status == 200 and p.text for p in people)
        assert max(p.ended_at or 0 for p in people) < min(a.ended_at or 0 for a in agents)
        for asked in agents:
            whole(asked, 300)  # batched with another, the text is not the lone run's: whole, not repeated
        # one pause per person, unless the second came when the first was done and its seat free (then none)
        pauses = len(paused(wrapper))
        assert 1 <= pauses <= 2 and len(wrapper.events("priority.resumed")) == pauses
        metrics = http("GET", f"{wrapper.url}/metrics")[2].decode()
        assert f"llama_wrapper_priority_paused_total {pauses}.0" in metrics
        assert f"llama_wrapper_priority_resumed_total {pauses}.0" in metrics
        assert "llama_wrapper_priority_interactive_wait_seconds_count" in metrics
        assert wrapper.stop() == 0


def test_an_agent_that_hangs_up_while_paused_is_let_go(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        background = agent(wrapper.url, 400).start()
        background.wait_tokens(40)
        question = person(wrapper.url, max_tokens=200).start()  # long enough to hang up while paused
        wait_for(lambda: paused(wrapper), 60, "the agent paused")
        background.hang_up()
        background.join()
        question.join()
        assert question.status == 200
        wait_for(lambda: wrapper.status()["priority"]["waiting"] == [] and not wrapper.status()["priority"]["running"],
                 30, "nothing left in the queue")
        assert not wrapper.events("priority.resumed")
        again = person(wrapper.url).start().join()  # the slot serves on
        assert again.status == 200 and again.text
        streaming = agent(wrapper.url, 2000).start()  # one that hangs up while it streams: llama-server stops
        streaming.wait_tokens(20)
        streaming.hang_up()
        streaming.join()
        wait_for(lambda: not any(s.get("is_processing") for s in json.loads(http("GET", f"{wrapper.url}/slots")[2])),
                 30, "llama-server to stop generating for nobody")
        assert wrapper.stop() == 0


@pytest.mark.parametrize("without", ["preempt-false", "no-cache"])
def test_without_preemption_the_question_still_goes_first_in_the_queue(
        tmp_path: Path, server_bin: str, demo_path: str, without: str) -> None:
    settings = config(tmp_path, ", preempt: false") if without == "preempt-false" else None
    with running(tmp_path, argv(server_bin, demo_path), settings) as wrapper:
        first = agent(wrapper.url, 200).start()
        first.wait_tokens(20)
        second = agent(wrapper.url, 200).start()
        wait_for(lambda: wrapper.status()["priority"]["waiting"], 30, "the second agent waiting")
        question = person(wrapper.url).start()
        wait_for(lambda: len(wrapper.status()["priority"]["waiting"]) == 2, 30, "the question waiting")
        assert [w["class"] for w in wrapper.status()["priority"]["waiting"]] == ["interactive", "background"]
        for asked in (question, first, second):
            asked.join()
        assert question.ended_at is not None and second.ended_at is not None and first.ended_at is not None
        assert first.ended_at < question.ended_at < second.ended_at  # nothing paused: after the first, first
        assert not paused(wrapper)
        whole(first, 200)
        whole(second, 200)
        assert wrapper.stop() == 0


def test_a_request_paused_max_pauses_times_runs_to_its_end(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, ", max_pauses: 1")) as wrapper:
        alone = agent(wrapper.url, 400, headers={}).start().join()
        background = agent(wrapper.url, 400).start()
        background.wait_tokens(30)
        person(wrapper.url).start().join()
        background.wait_tokens(120)
        late = person(wrapper.url).start().join()  # paused once already: this one waits for it
        background.join()
        assert len(paused(wrapper)) == 1
        assert background.ended_at is not None and late.ended_at is not None and background.ended_at < late.ended_at
        whole(background, 400)
        assert background.text == alone.text
        assert wrapper.stop() == 0


def test_a_reload_and_a_crash_while_paused_and_the_answer_is_whole(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        for pauses, trouble in enumerate(("reload", "crash"), start=1):
            background = agent(wrapper.url, 300).start()
            background.wait_tokens(40)
            question = person(wrapper.url, max_tokens=120).start()
            wait_for(partial(lambda n: len(paused(wrapper)) == n, pauses), 60, "the agent paused")
            if trouble == "reload":  # the question is drained, the new server restores the paused state
                status = http("POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 4096}, timeout=600,
                              headers={"Authorization": f"Bearer {TOKEN}"})[0]
                assert status == 200
            else:
                os.kill(wrapper.status()["server"]["pid"], signal.SIGKILL)
            question.join()
            background.join()
            assert question.status == 200
            whole(background, 300)
        assert wrapper.events("wrapper.server_lost") and len(wrapper.events("priority.resumed")) == 2
        assert wrapper.stop() == 0


def test_a_stop_while_paused_keeps_the_agents_conversation(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    short = config(tmp_path, sections="cache: {min_tokens: 64}\n")  # a restore of a hundred tokens pays here
    with running(tmp_path, argv(server_bin, demo_path), short) as wrapper:
        background = agent(wrapper.url, 400).start()
        background.wait_tokens(60)
        question = person(wrapper.url, max_tokens=200).start()
        (pause,) = wait_for(lambda: paused(wrapper), 60, "the agent paused")
        wrapper.signal_group(signal.SIGTERM)  # llama-swap swaps the model out
        assert wrapper.wait(120) == 0
        background.join()
        question.join()
        assert background.status == 200 and background.finals == 0  # its stream was told, not ended as whole
        assert b'"error"' in background.raw
    kept = pause["tokens"]
    with running(tmp_path, argv(server_bin, demo_path), short) as again:
        turn = agent(again.url, 8, stream=False, headers={})
        turn.body["messages"].append({"role": "assistant", "content": background.text})
        turn.start().join()
        assert turn.answer is not None and turn.answer["timings"]["cache_n"] >= 0.9 * kept  # it came back
        assert again.stop() == 0


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_a_person_is_answered_beside_each_kind_of_agent_on_the_readmes_config(
        tmp_path: Path, server_bin: str, demo_path: str, kind: Kind, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's config (`examples/chat.yaml`) with `priority.preempt: true`, the agent marked as the README shows
    (`"service_tier": "flex"` or `X-Priority: background`): the lane is on (the slots share one KV), so the person's
    question runs beside the agent's answer, whatever the agent sends, and reads no more of its prompt than it does
    alone (where a person lost a second behind an agent: its slot taken or forgotten). Times go to the output, not
    to an assertion."""
    template = ["--jinja", "--chat-template-file", models.template(server_bin, kind.template)] if kind.template else []
    with running(tmp_path, [*argv(server_bin, demo_path), *template],
                 chat_yaml(tmp_path, "priority: {preempt: true}\n")) as wrapper:
        lane = wrapper.status()["priority"]
        assert lane["slots"] == 2 and lane["lane"]["slots"] == 1, lane
        first, alone = [person(wrapper.url).start().join() for _ in range(2)]  # the second: as it is asked again
        for _ in range(2):  # the second: the agent's prompt from its slot, as the run beside the question reads it
            lone = kind.ask(wrapper.url, 300).start().join()
        assert lone.status == 200, lone.raw[:300]
        working = kind.ask(wrapper.url, 300)
        question = behind(wrapper, [working], check=lambda: wait_for(
            lambda: [r["slot"] for r in wrapper.status()["priority"]["running"]] in ([0], [1]), 30,
            "the agent's slot in the status (placed by the server, or pinned by the wrapper)"))
        assert question.status == 200 and question.text and working.status == 200, working.raw[:300]
        assert (question.ended_at or 0) < (working.ended_at or 0)  # beside it, not after it
        assert not paused(wrapper) and not wrapper.events("priority.not_paused")  # a seat was free: nothing paused
        read_alone, read_beside, whole_prompt = prompt_n(alone), prompt_n(question), prompt_n(first)
        assert read_alone is not None and read_beside is not None and whole_prompt is not None
        # llama-server places a Responses or Messages request itself, by the share of its prompt a slot holds: the
        # chat template's system prompt is enough to put the agent's first request where the person's short question
        # was, which is then read again
        assert read_beside <= (whole_prompt if kind.path in ("/v1/responses", "/v1/messages") else read_alone), \
            (read_beside, read_alone, whole_prompt)
        # whole (batched beside the question its text may part from its lone run's: llama-server computes a batch of
        # two in another order than one; the bench prints which it was)
        assert 0.8 * lone.tokens <= working.tokens <= 1.2 * lone.tokens, (working.tokens, lone.tokens)
        assert wrapper.stop() == 0
    with capsys.disabled():
        print(f"\n  {kind.name:<10} the person's first token alone {alone.first_token:.3f} s, beside the agent "
              f"{question.first_token:.3f} s; prompt tokens read {read_alone} alone, {read_beside} beside")


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_question_asked_as_an_agent_starts_is_not_queued_behind_it(
        tmp_path: Path, server_bin: str, demo_path: str, path: str) -> None:
    """llama-server places a Messages or Responses request itself, and on the chat template's system prompt alone it
    puts an agent's first request in the slot a person's short question holds. A question asked the moment the agent
    starts must not be pinned there before the server has placed the agent: it would queue behind the whole answer
    (a new user saw 316 s)."""
    kind = next(k for k in KINDS if k.path == path)
    template = models.template(server_bin, kind.template or "")
    with running(tmp_path, [*argv(server_bin, demo_path), "--jinja", "--chat-template-file", template],
                 chat_yaml(tmp_path, "priority: {preempt: true}\n")) as wrapper:
        assert person(wrapper.url).start().join().status == 200  # the person's slot: what the agent's first lands in
        working = kind.ask(wrapper.url, 300).start()
        wait_for(lambda: working.events or working.took is not None, 60, "the agent's stream to begin")
        question = person(wrapper.url).start().join()
        working.join()
        assert question.status == 200 and working.status == 200, working.raw[:300]
        assert (question.ended_at or 0) < (working.ended_at or 0)  # beside it, not behind it
        assert wrapper.stop() == 0


def test_without_the_lane_a_person_is_told_why_the_agent_is_not_paused(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        working = agent(wrapper.url, 300, headers={"Authorization": "Bearer agent-key"}, tools=TOOLS,
                        tool_choice="auto").start()
        working.wait_tokens(40)
        question = person(wrapper.url).start()
        told = wait_for(lambda: wrapper.status()["priority"]["waiting"], 60, "the question to wait")
        assert told[0]["behind"][0]["reason"] == "tools" and "tools" in told[0]["behind"][0]["why"]
        question.join()
        working.join()
        (event,) = wrapper.events("priority.not_paused")
        assert event["behind"][0]["reason"] == "tools" and not paused(wrapper)
        metrics = http("GET", f"{wrapper.url}/metrics")[2].decode()
        assert 'llama_wrapper_priority_not_paused_total{reason="tools"} 1.0' in metrics
        assert wrapper.stop() == 0
