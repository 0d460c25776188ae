"""A crash or a hang of the real llama-server costs a client a pause, never a conversation: SIGKILL in the middle
of a streamed and of a whole answer, SIGSTOP (a hang), and what the slots held comes back (checkpoints, then
slots.restore when the watchdog starts it again)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from datetime import datetime
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from tests import models
from tests.helpers import Wrapper, chat, http, pid_alive, running, wait_for
from tests.killing import deltas, killed_while_answering, server_pid, streamed

CONFIG = """
slots: {{dir: {dir}}}
watchdog: {{health_timeout: {health}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
QUESTION = "A long story, to be retold: " + STORY * 80 + "\nNow tell it again in your own words."  # ~1.7k tokens
LONG = "A long story, to be retold: " + STORY * 165 + "\nNow tell it again in your own words."  # ~3k tokens
ONE_BATCH = ["-c", "8192", "-b", "4096", "-ub", "4096", "-t", "1", "-np", "1"]  # the whole prompt in one batch
STALL = "watchdog: {stall: 5s}\n"


def config(tmp_path: Path, health: str = "5s") -> str:
    return CONFIG.format(dir=tmp_path / "slots", health=health)


def argv(server_bin: str, demo_path: str, parallel: int = 2) -> list[str]:
    return [server_bin, "-m", demo_path, "-c", "8192", "-np", str(parallel)]


def reused(answer: dict[str, Any]) -> int:
    return int(answer["timings"]["cache_n"])


def stream_killed(wrapper: Wrapper, messages: list[dict[str, str]], kill_after: int | None,
                  sig: signal.Signals = signal.SIGKILL, max_tokens: int = 120,
                  signalled: list[float] | None = None) -> tuple[list[dict[str, Any]], int]:
    """A streamed chat answer read event by event; `kill_after` content events in, llama-server gets `sig` (its
    time.time() appended to `signalled`). Every event the client saw, and how many content events came before the
    signal."""
    host, port = wrapper.url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=600)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    events: list[dict[str, Any]] = []
    before = 0
    pid = server_pid(wrapper)
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        events.append({"done": True} if data == "[DONE]" else json.loads(data))
        if kill_after is not None and before == 0 and _contents(events) >= kill_after:
            before = _contents(events)
            os.kill(pid, sig)
            if signalled is not None:
                signalled.append(time.time())
    connection.close()
    return events, before


def _contents(events: list[dict[str, Any]]) -> int:
    return sum(1 for e in events if (e.get("choices") or [{}])[0].get("delta", {}).get("content"))


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join((e.get("choices") or [{}])[0].get("delta", {}).get("content") or "" for e in events)


def test_a_stream_survives_a_sigkill_as_one_answer_and_the_conversation_comes_back(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        wrapper_pid = wrapper.process.pid
        first = [{"role": "user", "content": QUESTION}]
        answer = chat(wrapper.url, first, max_tokens=24)
        history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Go on with the story, please."}]
        wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the conversation kept while idle")
        assert wrapper.status()["slots"]["conversations"]["unkept_tokens"] == 0  # a crash now costs nothing
        killed_pid = server_pid(wrapper)
        events, before = stream_killed(wrapper, turn, kill_after=20)
        assert before >= 20 and not pid_alive(killed_pid) and server_pid(wrapper) != killed_pid
        assert wrapper.process.poll() is None and wrapper.process.pid == wrapper_pid  # the wrapper kept running
        finishes = [e for e in events if (e.get("choices") or [{}])[0].get("finish_reason")]
        assert len(finishes) == 1 and events[-1] == {"done": True} and sum("done" in e for e in events) == 1
        roles = [e for e in events if (e.get("choices") or [{}])[0].get("delta", {}).get("role")]
        assert len(roles) == 1  # one answer: the continuation's own role chunk is not shown
        text = text_of(events)
        kept = text_of(events[:before + 1])
        resumed = text[len(kept):]
        assert text.startswith(kept) and resumed.strip(), text  # it picked up where it stopped
        assert not resumed.startswith(kept[-12:]) and not resumed.startswith(kept[:12])  # not repeated, not again
        assert 115 <= _contents(events) <= 125  # the tokens it asked for, none lost (the prefix may split a token)
        (lost,) = wrapper.events("wrapper.server_lost")
        assert lost["reason"] == "crash" and lost["why"] == "killed by SIGKILL"
        assert wrapper.events("wrapper.request_again") and wrapper.events("wrapper.stream_resumed")
        following = chat(wrapper.url, [*turn, {"role": "assistant", "content": text},
                                       {"role": "user", "content": "Thank you."}], max_tokens=24)
        assert reused(following) >= 0.9 * history, (reused(following), history)  # the conversation came back
        assert wrapper.status()["restarts"]["count"] == 1
        assert wrapper.stop() == 0


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_turn_after_a_crashed_stream_reuses_the_whole_conversation(
        tmp_path: Path, server_bin: str, demo_path: str, parallel: int) -> None:
    """The continued stream ran in its slot on the server started again: the next turn goes on there (or from what
    was kept of it), whatever the number of slots, reading again only what the crash cost the book."""
    with running(tmp_path, argv(server_bin, demo_path, parallel), config(tmp_path)) as wrapper:
        first = [{"role": "user", "content": QUESTION}]
        answer = chat(wrapper.url, first, max_tokens=24)
        turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Go on with the story, please."}]
        wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the conversation kept while idle")
        events, before = stream_killed(wrapper, turn, kill_after=20, max_tokens=360)  # a good part of what it holds
        assert before >= 20 and wrapper.events("wrapper.stream_resumed") and events[-1] == {"done": True}
        text = text_of(events)
        following = chat(wrapper.url, [*turn, {"role": "assistant", "content": text},
                                       {"role": "user", "content": "Thank you."}], max_tokens=8)
        template = json.loads(http("POST", f"{wrapper.url}/apply-template", {"messages": turn})[2])["prompt"]
        prompt = len(json.loads(http("POST", f"{wrapper.url}/tokenize", {"content": template, "add_special": True,
                                                                          "parse_special": True})[2])["tokens"])
        history = prompt + _contents(events)  # the crashed turn's prompt and its whole continued answer
        where = [(e["event"], e.get("slot"), e.get("tokens") or e.get("entry_tokens")) for e in wrapper.events()
                 if e.get("event") in ("slots.restored", "conversations.decision", "conversations.saved")]
        assert reused(following) >= 0.9 * history, (reused(following), history, where)  # not the checkpoint alone
        assert wrapper.stop() == 0


@pytest.mark.parametrize("parallel", [2, 4])
def test_the_turn_after_a_crash_of_a_short_conversation_goes_to_its_slot(
        tmp_path: Path, server_bin: str, demo_path: str, parallel: int) -> None:
    """Nothing of a short conversation was kept (shorter than cache.min_tokens): after a crash mid-stream its
    continued answer is in one slot of the server started again, and the next turn, the new server's first looked-up
    request, goes there (it went to another slot and read everything again: the book did not know the slots yet)."""
    with running(tmp_path, argv(server_bin, demo_path, parallel), config(tmp_path)) as wrapper:
        first = [{"role": "user", "content": "Name three colours."}]
        answer = chat(wrapper.url, first, max_tokens=32)
        turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
        events, before = stream_killed(wrapper, turn, kill_after=20, max_tokens=300)
        assert before >= 20 and wrapper.events("wrapper.stream_resumed") and events[-1] == {"done": True}
        following = chat(wrapper.url, [*turn, {"role": "assistant", "content": text_of(events)},
                                       {"role": "user", "content": "Thank you."}], max_tokens=8)
        history = following["usage"]["prompt_tokens"]
        assert reused(following) >= 0.9 * history, (reused(following), history)
        assert wrapper.stop() == 0


def test_a_stream_killed_at_its_first_token_is_not_degraded(tmp_path: Path, server_bin: str,
                                                             demo_path: str) -> None:
    """Llama 3.1's template, killed one content event in (the demo model's answer begins "\n"): that "\n" read
    back as a prefix after the template's own "\n\n" was tokenized another way, and the answer went on
    "#\n\n##..." to its end (a fresh pair of eyes, every time). With no word begun the request goes again from
    the start: at temperature 0, its lone run's text."""
    messages = [{"role": "user", "content": "Write a long poem about the sea, with ten stanzas."}]
    template = models.template(server_bin, "meta-llama-Llama-3.1-8B-Instruct")  # its header ends "\n\n"
    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone, _ = stream_killed(wrapper, messages, None, max_tokens=80)
        events, before = stream_killed(wrapper, messages, kill_after=1, max_tokens=80)
        assert before == 1 and wrapper.events("wrapper.stream_resumed")
        assert sum(1 for e in events if (e.get("choices") or [{}])[0].get("finish_reason")) == 1
        assert text_of(events) == text_of(alone), (text_of(events)[:200], text_of(alone)[:200])
        assert wrapper.stop() == 0


def test_a_whole_answer_survives_a_sigkill(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        pid = server_pid(wrapper)
        status, raw = killed_while_answering(wrapper, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 200, "temperature": 0})
        assert status == 200, raw[:300]
        answer = json.loads(raw)
        assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0, answer
        assert wrapper.events("wrapper.request_again") and server_pid(wrapper) != pid
        assert wrapper.stop() == 0


def test_a_hang_is_noticed_and_the_stream_goes_on(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, health="3s")) as wrapper:
        began = time.monotonic()
        events, before = stream_killed(wrapper, [{"role": "user", "content": "Tell me a long story."}],
                                       kill_after=10, sig=signal.SIGSTOP)
        assert before >= 10 and events[-1] == {"done": True}
        (lost,) = wrapper.events("wrapper.server_lost")
        assert lost["reason"] == "hang", lost
        noticed = wrapper.events("wrapper.restarting_server")[0]
        assert noticed["on"] == "hang"
        assert time.monotonic() - began < 120
        assert wrapper.stop() == 0


def test_a_prompt_batch_longer_than_the_stall_is_computing_not_a_hang(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    """No slot shows progress inside one batch (/slots waits for it), but llama-server's CPU time moves."""
    with running(tmp_path, [server_bin, "-m", demo_path, *ONE_BATCH], STALL) as wrapper:
        answer = chat(wrapper.url, [{"role": "user", "content": LONG}], max_tokens=8)
        assert answer["usage"]["prompt_tokens"] > 3000
        assert answer["timings"]["prompt_ms"] > 5000, answer["timings"]  # the batch outlasted the stall
        assert not wrapper.events("wrapper.server_lost")
        assert wrapper.stop() == 0


def test_a_stopped_server_is_still_noticed_within_the_stall(tmp_path: Path, server_bin: str,
                                                            demo_path: str) -> None:
    """SIGSTOP: its CPU time stands still, and the stall rule (not /health: 30 s) notices it."""
    with running(tmp_path, [server_bin, "-m", demo_path, *ONE_BATCH], STALL) as wrapper:
        stopped: list[float] = []
        events, before = stream_killed(wrapper, [{"role": "user", "content": "Tell me a long story."}],
                                       kill_after=10, sig=signal.SIGSTOP, signalled=stopped)
        assert before >= 10 and events[-1] == {"done": True}
        (lost,) = wrapper.events("wrapper.server_lost")
        assert lost["reason"] == "hang" and "no slot made progress" in lost["why"], lost
        noticed = datetime.fromisoformat(lost["timestamp"]).timestamp() - stopped[0]
        assert noticed < 5 + 2 * 5 / 3 + 1, noticed  # the stall, then at most a look and its probes
        assert wrapper.stop() == 0


def test_a_crash_during_the_stops_save_loses_no_kept_conversation(tmp_path: Path, server_bin: str,
                                                                   demo_path: str) -> None:
    first = [{"role": "user", "content": QUESTION}]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        answer = chat(wrapper.url, first, max_tokens=24)
        history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the conversation kept while idle")
        pid = server_pid(wrapper)
        wrapper.signal_group(signal.SIGTERM)  # llama-swap stops the model, and the server dies under the save
        os.kill(pid, signal.SIGKILL)
        wrapper.wait(60)
    turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Thank you."}]
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as again:
        assert reused(chat(again.url, turn, max_tokens=24)) >= 0.9 * history  # the checkpoint, restored at the start
        assert again.stop() == 0


def test_a_crash_between_turns_loses_nothing_when_the_answer_made_the_growth(tmp_path: Path, server_bin: str,
                                                                             demo_path: str) -> None:
    """A prompt under cache.checkpoint_tokens (1024) whose answer takes the slot past it is kept while idle: the
    answer's tokens count, as the next turn reads them again."""
    first = [{"role": "user", "content": "A story: " + STORY * 40 + "\nTell it again."}]  # ~760 tokens
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        answer = chat(wrapper.url, first, max_tokens=320, ignore_eos=True)
        history = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        assert answer["usage"]["prompt_tokens"] < 1024 <= history
        (kept,) = wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the conversation kept while idle")
        assert kept["tokens"] >= history - 1
        pid = server_pid(wrapper)
        os.kill(pid, signal.SIGKILL)  # between turns
        wait_for(lambda: wrapper.events("wrapper.server_back"), 60, "the server started again")
        turn = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Thank you."}]
        assert reused(chat(wrapper.url, turn, max_tokens=8)) >= 0.9 * history
        assert wrapper.stop() == 0


def _agent_turn(wrapper: Wrapper, path: str, said: list[str]) -> tuple[str, int, int]:
    """One turn of an agent on the Messages or Responses API (what was said so far, the user's turns first and
    last): its answer's text, the prompt's tokens and those read from the cache."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(said)]
    body = {"model": "demo", "max_tokens": 16, "messages": turns} if path == "/v1/messages" else \
        {"model": "demo", "max_output_tokens": 16, "input": [  # an answer goes back as the output item it was
            turn if turn["role"] == "user" else {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": turn["content"]}]} for turn in turns]}
    status, _, raw = http("POST", f"{wrapper.url}{path}", body, timeout=300)
    assert status == 200, raw[:300]
    answer = json.loads(raw)
    usage = answer["usage"]
    if path == "/v1/messages":
        text = "".join(block.get("text", "") for block in answer["content"])
        cached = int(usage.get("cache_read_input_tokens") or 0)
        return text, int(usage["input_tokens"]) + cached, cached
    text = "".join(part.get("text", "") for item in answer["output"] if item.get("type") == "message"
                   for part in item.get("content", []))
    return text, int(usage["input_tokens"]), int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.parametrize("parallel", [1, 2])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_a_crash_between_an_agents_messages_or_responses_turns_loses_nothing(
        tmp_path: Path, server_bin: str, demo_path: str, path: str, parallel: int) -> None:
    """The wrapper tells a Messages or Responses request's prompt as llama-server makes it (Responses pinned,
    Messages prepared where the server's rule puts it), so its slot is tracked like a chat request's and a checkpoint
    keeps it (before: untracked until a quiet moment, and before that a crash read the whole conversation again); a
    SIGKILL between turns costs the next turn nothing."""
    with running(tmp_path, argv(server_bin, demo_path, parallel), config(tmp_path)) as wrapper:
        said = [QUESTION]
        text, prompt, _ = _agent_turn(wrapper, path, said)
        (kept,) = wait_for(lambda: wrapper.events("conversations.checkpoint"), 30, "the slot kept")
        assert "untracked" not in kept and kept["tokens"] >= prompt, kept

        def safe() -> bool:  # every slot kept or known to hold too little (the others are saved one by one)
            conversations = wrapper.status()["slots"]["conversations"]
            return bool(conversations["untracked_slots"] == [] and conversations["unkept_tokens"] == 0)

        wait_for(safe, 30, "nothing left that a crash would cost")
        os.kill(server_pid(wrapper), signal.SIGKILL)  # between turns
        wait_for(lambda: wrapper.events("wrapper.server_back"), 60, "the server started again")
        _, again, cached = _agent_turn(wrapper, path, [*said, text, "Go on."])
        assert cached >= 0.9 * prompt and again > prompt, (cached, again, prompt)
        assert wrapper.stop() == 0


def test_a_crash_while_a_reload_drains_leaves_the_reload_and_the_request_whole(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    token = "watchdog-token"
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": token}) as wrapper:
        answers: list[dict[str, Any]] = []
        asking = threading.Thread(target=lambda: answers.append(chat(wrapper.url, [
            {"role": "user", "content": QUESTION}], max_tokens=150)))
        asking.start()
        wait_for(lambda: any(s.get("is_processing") for s in json.loads(http("GET", f"{wrapper.url}/slots")[2])),
                 60, "the answer under way")
        old = server_pid(wrapper)
        reloading: list[int] = []
        reload = threading.Thread(target=lambda: reloading.append(http(
            "POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 4096}, timeout=600,
            headers={"Authorization": f"Bearer {token}"})[0]))
        reload.start()
        wait_for(lambda: wrapper.status()["state"] == "reloading", 30, "the reload to drain")
        os.kill(old, signal.SIGKILL)
        reload.join(300)
        asking.join(300)
        assert answers and answers[0]["choices"][0]["message"]["content"]  # sent again to the new server
        assert reloading and wrapper.status()["state"] == "ready" and server_pid(wrapper) != old
        assert wrapper.stop() == 0


def _whole_and_once(events: list[dict[str, Any]]) -> None:
    """One answer: one role chunk, one final event, one [DONE], no error, one id."""
    assert not any("error" in e for e in events), events[-3:]
    assert sum(1 for d in deltas(events) if d.get("role")) == 1
    assert sum(1 for e in events if e.get("choices") and e["choices"][0].get("finish_reason")) == 1
    assert events[-1] == {"done": True} and sum("done" in e for e in events) == 1
    assert len({e["id"] for e in events if "id" in e}) == 1


def test_a_reasoning_stream_survives_a_sigkill_with_its_reasoning_once(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    """A DeepSeek R1 distill's template: everything streams as reasoning. Killed 30 reasoning events in, the answer
    goes on within its reasoning: the client's reasoning is not sent again (it was: 1,640-1,753 characters against
    1,250)."""
    template = models.template(server_bin, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B")
    body = {"messages": [{"role": "user", "content": "Why is the sky blue? Explain briefly."}], "max_tokens": 200,
            "temperature": 0}
    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone = "".join(d.get("reasoning_content") or "" for d in deltas(streamed(wrapper, body)))
        events = streamed(wrapper, body, lambda seen: sum(bool(d.get("reasoning_content"))
                                                           for d in deltas(seen)) >= 30)
        _whole_and_once(events)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas(events))
        kept = "".join(d.get("reasoning_content") or "" for d in deltas(events)[:31])
        assert reasoning.startswith(kept) and reasoning.count(kept) == 1  # what the client had, once
        assert 0.8 * len(alone) <= len(reasoning) <= 1.2 * len(alone), (len(reasoning), len(alone))
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0


def test_a_tool_call_under_way_survives_a_sigkill_as_one_call(tmp_path: Path, server_bin: str,
                                                               demo_path: str) -> None:
    """Llama 3.1's template, tool_choice required: the demo model writes a line, then a write_file call. Killed 3
    argument chunks into the call, the call is made again by the server started again and the client is shown only
    what it lacks: one call, one id, its name once, its arguments whole (it got two calls: a second id, the name
    again, 256 characters where the call has 183). The server started again reads the prompt afresh, which computes
    its KV another way than the one that decoded: what comes after the cut may differ from the lone run's."""
    template = models.template(server_bin, "meta-llama-Llama-3.1-8B-Instruct")
    tool = {"type": "function", "function": {"name": "write_file", "description": "Write a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}}
    body = {"messages": [{"role": "user", "content": "Read the file README.md please."}], "max_tokens": 120,
            "temperature": 0, "tools": [tool], "tool_choice": "required"}

    def calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c for d in deltas(events) for c in d.get("tool_calls") or []]

    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone = streamed(wrapper, body)
        assert calls(alone), "the demo model made no call: the template or the prompt changed"
        events = streamed(wrapper, body, lambda seen: len(calls(seen)) >= 4)
        _whole_and_once(events)
        parts = calls(events)
        assert len({c["id"] for c in parts if "id" in c}) == 1  # one id, the first
        assert sum(1 for c in parts if (c.get("function") or {}).get("name")) == 1  # its name once
        arguments = "".join((c.get("function") or {}).get("arguments") or "" for c in parts)
        expected = "".join((c.get("function") or {}).get("arguments") or "" for c in calls(alone))
        cut = "".join((c.get("function") or {}).get("arguments") or "" for c in parts[:4])
        assert expected.startswith(cut) and arguments.startswith(cut)  # what the client had stands
        assert set(json.loads(arguments)) == set(json.loads(expected)) == {"path", "content"}  # whole, valid JSON
        final = next(e for e in events if e.get("choices") and e["choices"][0].get("finish_reason"))
        assert final["choices"][0]["finish_reason"] == "tool_calls"
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0


def _typed(wrapper: Wrapper, path: str, body: dict[str, Any], kill_when: Any = None) -> list[dict[str, Any]]:
    """A streamed Responses or Messages answer (`event:` and `data:` lines), as _streamed reads it."""
    return streamed(wrapper, body, kill_when, path)


def _of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def _said(events: list[dict[str, Any]], kind: str, key: str = "delta") -> str:
    return "".join(e[key] if isinstance(e[key], str) else e[key].get("text") or e[key].get("thinking") or
                   e[key].get("partial_json") or "" for e in _of(events, kind))


def _one_response(events: list[dict[str, Any]]) -> dict[str, Any]:
    """One Responses answer: opened once, completed once under the id it opened with, no error; each item added
    once and every delta under an item the client was shown. The completed response."""
    assert not _of(events, "error") and not _of(events, "response.failed"), events[-3:]
    (created,) = _of(events, "response.created")
    (done,) = _of(events, "response.completed")
    assert done["response"]["id"] == created["response"]["id"] and events[-1] is done
    added = [e["item"]["id"] for e in _of(events, "response.output_item.added")]
    assert len(added) == len(set(added)) and {e["item_id"] for e in events if "item_id" in e} <= set(added)
    assert [item["id"] for item in done["response"]["output"]] == added
    response: dict[str, Any] = done["response"]
    return response


def _one_message(events: list[dict[str, Any]]) -> None:
    """One Messages answer: started and stopped once, no error, each block started once and stopped once, every
    delta in a block the client was shown."""
    assert not _of(events, "error"), events[-3:]
    assert len(_of(events, "message_start")) == 1 and len(_of(events, "message_delta")) == 1
    assert events[-1]["type"] == "message_stop" and len(_of(events, "message_stop")) == 1
    started = [e["index"] for e in _of(events, "content_block_start")]
    assert started == list(range(len(started)))  # each once, in order
    assert sorted(e["index"] for e in _of(events, "content_block_stop")) == started
    assert {e["index"] for e in _of(events, "content_block_delta")} <= set(started)


def test_a_responses_stream_survives_a_sigkill_as_one_response(tmp_path: Path, server_bin: str,
                                                              demo_path: str) -> None:
    """The Responses API (an agent's, Codex's): killed 30 text deltas in, the stream goes on in the same response
    and the same message item, without the text the client had again, and completes once with that text. The answer
    runs to its limit (ignore_eos) and is long enough that the kill comes while it is generated however late a busy
    machine lets the client read (with 120 tokens and the model's own end, a late kill found the answer over)."""
    body = {"input": "Tell me a long story about a lighthouse keeper.", "max_output_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    with running(tmp_path, argv(server_bin, demo_path, 1), config(tmp_path)) as wrapper:
        alone = _said(_typed(wrapper, "/v1/responses", body), "response.output_text.delta")
        events = _typed(wrapper, "/v1/responses", body,
                        lambda seen: len(_of(seen, "response.output_text.delta")) >= 30)
        response = _one_response(events)
        text = _said(events, "response.output_text.delta")
        kept = _said(events[:events.index(_of(events, "response.output_text.delta")[29]) + 1],
                     "response.output_text.delta")
        assert text.startswith(kept) and text.count(kept) == 1 and alone.startswith(kept)  # what it had, once
        (message,) = [item for item in response["output"] if item["type"] == "message"]
        assert message["content"][0]["text"] == text  # the whole answer, as shown
        assert 0.8 * len(alone) <= len(text) <= 1.2 * len(alone), (len(text), len(alone))
        assert response["usage"]["output_tokens"] == 300  # the whole answer's, not the last part's
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0


def test_a_responses_tool_call_under_way_survives_a_sigkill_as_one_call(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    """Llama 3.1's template, tool_choice required, the Responses API: killed 3 argument deltas into the call, the
    call is made again and the client is shown only what it lacks: one function_call item, one call_id, its
    arguments whole."""
    template = models.template(server_bin, "meta-llama-Llama-3.1-8B-Instruct")
    tool = {"type": "function", "name": "write_file", "description": "Write a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}
    body = {"input": "Read the file README.md please.", "max_output_tokens": 120, "temperature": 0,
            "tools": [tool], "tool_choice": "required"}
    delta = "response.function_call_arguments.delta"
    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone = _typed(wrapper, "/v1/responses", body)
        assert _of(alone, delta), "the demo model made no call: the template or the prompt changed"
        events = _typed(wrapper, "/v1/responses", body, lambda seen: len(_of(seen, delta)) >= 3)
        response = _one_response(events)
        calls = [e["item"] for e in _of(events, "response.output_item.added") if e["item"]["type"] == "function_call"]
        (call,) = [item for item in response["output"] if item["type"] == "function_call"]
        assert len(calls) == 1 and (call["id"], call["call_id"]) == (calls[0]["id"], calls[0]["call_id"])
        arguments = _said(events, delta)
        cut = _said(events[:events.index(_of(events, delta)[2]) + 1], delta)
        assert arguments.startswith(cut) and _said(alone, delta).startswith(cut)  # what the client had stands
        assert call["arguments"] == arguments and set(json.loads(arguments)) == {"path", "content"}
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0


def test_a_messages_stream_survives_a_sigkill_in_its_thinking_as_one_message(tmp_path: Path, server_bin: str,
                                                                             demo_path: str) -> None:
    """The Messages API (Claude Code's) with a DeepSeek R1 distill's template: killed 30 thinking deltas in, the
    answer goes on within its thinking block, shown once, in the blocks the client has."""
    template = models.template(server_bin, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B")
    body = {"messages": [{"role": "user", "content": "Why is the sky blue? Explain briefly."}], "max_tokens": 200,
            "temperature": 0}
    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone = _said(_typed(wrapper, "/v1/messages", body), "content_block_delta")
        events = _typed(wrapper, "/v1/messages", body, lambda seen: len(_of(seen, "content_block_delta")) >= 30)
        _one_message(events)
        said = _said(events, "content_block_delta")
        kept = _said(events[:events.index(_of(events, "content_block_delta")[29]) + 1], "content_block_delta")
        assert said.startswith(kept) and said.count(kept) == 1 and alone.startswith(kept)
        assert _of(events, "content_block_start")[0]["content_block"]["type"] == "thinking"
        assert 0.8 * len(alone) <= len(said) <= 1.2 * len(alone), (len(said), len(alone))
        assert 180 <= _of(events, "message_delta")[0]["usage"]["output_tokens"] <= 210  # the whole answer's
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0


def test_a_messages_tool_use_under_way_survives_a_sigkill_as_one_block(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    """Llama 3.1's template, the Messages API, tool_choice any: killed 3 input_json deltas into the tool_use block,
    the call is made again and shown in the client's block: one tool_use block, one id, its input whole."""
    template = models.template(server_bin, "meta-llama-Llama-3.1-8B-Instruct")
    tool = {"name": "write_file", "description": "Write a file", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}
    body = {"messages": [{"role": "user", "content": "Read the file README.md please."}], "max_tokens": 120,
            "temperature": 0, "tools": [tool], "tool_choice": {"type": "any"}}

    def jsondeltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [e for e in _of(events, "content_block_delta") if e["delta"]["type"] == "input_json_delta"]

    with running(tmp_path, [*argv(server_bin, demo_path, 1), "--jinja", "--chat-template-file", template],
                 config(tmp_path)) as wrapper:
        alone = jsondeltas(_typed(wrapper, "/v1/messages", body))
        assert alone, "the demo model made no call: the template or the prompt changed"
        events = _typed(wrapper, "/v1/messages", body, lambda seen: len(jsondeltas(seen)) >= 3)
        _one_message(events)
        uses = [e for e in _of(events, "content_block_start") if e["content_block"]["type"] == "tool_use"]
        assert len(uses) == 1 and {e["index"] for e in jsondeltas(events)} == {uses[0]["index"]}
        arguments = "".join(e["delta"]["partial_json"] for e in jsondeltas(events))
        cut = "".join(e["delta"]["partial_json"] for e in jsondeltas(events)[:3])
        assert arguments.startswith(cut) and "".join(e["delta"]["partial_json"] for e in alone).startswith(cut)
        assert set(json.loads(arguments)) == {"path", "content"}
        assert _of(events, "message_delta")[0]["delta"]["stop_reason"] == "tool_use"
        assert wrapper.events("wrapper.stream_resumed") and wrapper.stop() == 0
