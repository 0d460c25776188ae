"""Reloads against the real llama-server: new settings, the same conversations, no request lost."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import Wrapper, http, running, wait_for

TOKEN = "reload-token-7f3a"
PERSIST = """
slots: {{dir: {dir}}}
reload: {{overlap: {overlap}}}
hooks:
  on_startup:
    - builtin: slots.restore
  on_will_stop:
    - builtin: slots.save
  on_reload:
    - shell: echo reloaded {{{{ reload.success }}}} {{{{ reload.changes | length }}}} >> {log}
"""
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
STORY = "The lighthouse keeper counted the ships that passed the northern cape each night. "


def config(tmp_path: Path, overlap: str = "auto") -> str:
    return PERSIST.format(dir=tmp_path / "slots", overlap=overlap, log=tmp_path / "reloads.log")


def reload(wrapper: Wrapper, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", body, timeout=300,
                          headers=ADMIN if headers is None else headers)
    return status, json.loads(raw)


def complete(url: str, prompt: str) -> dict[str, Any]:
    status, _, raw = http("POST", f"{url}/completion", {"prompt": prompt, "n_predict": 4, "temperature": 0,
                                                         "cache_prompt": True}, timeout=300)
    assert status == 200, raw
    result: dict[str, Any] = json.loads(raw)
    return result


@pytest.mark.parametrize(("model", "change", "converted"), [
    ("tiny", {"n_ctx": 16384}, None),
    ("tiny", {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}, "f16/f16 -> q8_0/q8_0"),
    ("demo", {"n_ctx": 8192, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}, "f16/f16 -> q8_0/q8_0"),  # trained: 8k
    ("demo", {"cache_type_k": "q4_0", "cache_type_v": "q4_0"}, "f16/f16 -> q4_0/q4_0"),
    ("gemma", {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0"}, "f16/f16 -> q8_0/q8_0"),
])
def test_a_reload_keeps_the_conversation(tmp_path: Path, server_bin: str, tiny_path: str, demo_path: str,
                                         gemma_path: str, model: str, change: dict[str, Any],
                                         converted: str | None) -> None:
    """A conversation of ~3k tokens, then a 4x context and other K/V types: the next turn reuses >= 95 %.
    The demo model's and Gemma's quantized caches are Hadamard-rotated; Gemma has a sliding window."""
    path = {"tiny": tiny_path, "demo": demo_path, "gemma": gemma_path}[model]
    argv = [server_bin, "-m", path, "-c", "4096", "-np", "1"]
    history = STORY * (150 if model == "tiny" else 180)
    with running(tmp_path, argv, config(tmp_path), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        turn = complete(wrapper.url, history)
        tokens = turn["tokens_evaluated"] + turn["tokens_predicted"]
        assert 2500 < tokens < 4096
        old_pid = wrapper.status()["server"]["pid"]
        status, answer = reload(wrapper, change)
        assert status == 200 and answer["success"], answer
        assert answer["n_ctx"] == change.get("n_ctx", 4096) and answer["downtime_ms"] > 0
        (slot,) = answer["slots"]
        assert slot["outcome"] == "restored", slot  # converted where the types changed, never prefilled
        if converted is not None:
            assert f"{slot['conversion']['from']} -> {slot['conversion']['to']}" == converted
        state = wrapper.status()
        assert state["state"] == "ready" and state["server"]["pid"] != old_pid
        assert state["last_reload"]["success"] and state["last_reload"]["changes"] == answer["changes"]
        nxt = complete(wrapper.url, history + turn["content"] + " And then")
        assert nxt["timings"]["cache_n"] >= 0.95 * tokens, (nxt["timings"], tokens)
        assert wrapper.stop() == 0
    assert (tmp_path / "reloads.log").read_text().splitlines() == [f"reloaded True {len(answer['changes'])}"]
    print(f"\nreload {model} {change}: {answer['downtime_ms']} ms downtime, overlap {answer['overlap']}, "
          f"conversion {slot.get('conversion')}, cache_n {nxt['timings']['cache_n']} of {tokens}")


async def _stream(url: str, index: int) -> int:
    body = {"prompt": f"Client {index} says:", "n_predict": 8, "stream": True}
    async with aiohttp.ClientSession() as session, session.post(f"{url}/completion", json=body) as reply:
        data = await reply.read()
        assert reply.status != 200 or b'"stop":true' in data
        return reply.status


def test_clients_that_arrive_during_a_reload_are_all_answered(tmp_path: Path, server_bin: str,
                                                              demo_path: str) -> None:
    """Sequential, so that the window in which requests are held spans a model load and the test sees it."""
    argv = [server_bin, "-m", demo_path, "-c", "2048", "-np", "2"]
    with running(tmp_path, argv, config(tmp_path, "never"), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        complete(wrapper.url, STORY * 5)
        done: list[Any] = []
        reloading = threading.Thread(target=lambda: done.append(subprocess.run(
            [sys.executable, "-m", "wrapper.cli", "reload", "--url", wrapper.url, "--ctx", "4096"],
            capture_output=True, text=True, env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN, "PATH": "/usr/bin:/bin"})))
        reloading.start()
        wait_for(lambda: wrapper.status()["state"] == "reloading", 60, "the reload to begin", interval=0.01)

        async def eight() -> list[int]:
            return list(await asyncio.gather(*(_stream(wrapper.url, i) for i in range(8))))

        assert asyncio.run(eight()) == [200] * 8
        reloading.join(120)
        assert done[0].returncode == 0, done[0].stderr
        assert "reloaded: n_ctx 4096" in done[0].stdout
        assert "  -c 2048 -> 4096" in done[0].stdout.splitlines()  # what changed, without --json
        assert wrapper.status()["state"] == "ready"


def test_a_reload_is_refused_before_anything_stops(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    with running(tmp_path, argv, config(tmp_path), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        pid = wrapper.status()["server"]["pid"]
        assert reload(wrapper, {"n_ctx": 4096}, headers={})[0] == 401
        assert reload(wrapper, {"n_ctx": 4096}, headers={"Authorization": "Bearer nope"})[0] == 401
        status, answer = reload(wrapper, {"args": {"set": {"--no-such-flag": "1"}}})
        assert status == 400 and "does not know --no-such-flag" in answer["error"]["message"]
        status, answer = reload(wrapper, {"args": {"set": {"--port": "1"}}, "n_ctx": -3, "bogus": 1})
        message = answer["error"]["message"]
        assert status == 400 and "--port cannot be changed" in message and "n_ctx must be" in message
        assert "unknown field(s) bogus" in message
        assert wrapper.status()["server"]["pid"] == pid and wrapper.health() == 200
        complete(wrapper.url, "Still serving.")


def test_without_an_admin_token_reload_is_off(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024"]) as wrapper:
        status, answer = reload(wrapper, {"n_ctx": 2048})
        assert status == 403 and "LLAMA_WRAPPER_ADMIN_TOKEN" in answer["error"]["message"]


@pytest.mark.parametrize("overlap", ["always", "never"])
def test_a_reload_whose_server_does_not_start_rolls_back(tmp_path: Path, server_bin: str, tiny_path: str,
                                                         overlap: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    with running(tmp_path, argv, config(tmp_path, overlap), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        history = STORY * 20
        turn = complete(wrapper.url, history)
        status, answer = reload(wrapper, {"mmproj": {"path": str(tmp_path / "no-such-mmproj.gguf")}})
        assert status == 500 and not answer["success"] and "previous settings are back" in answer["message"]
        state = wrapper.status()
        assert state["state"] == "ready" and "no-such-mmproj" not in json.dumps(state["server"]["argv"])
        nxt = complete(wrapper.url, history + turn["content"] + " And then")
        assert nxt["timings"]["cache_n"] >= 0.95 * (turn["tokens_evaluated"] + turn["tokens_predicted"])
        assert wrapper.stop() == 0


def test_sigterm_during_a_reload_stops_with_the_slots_saved(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    with running(tmp_path, argv, config(tmp_path, "never"), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        complete(wrapper.url, STORY * 20)
        thread = threading.Thread(target=lambda: reload(wrapper, {"n_ctx": 4096}))
        thread.start()
        wait_for(lambda: wrapper.status()["state"] == "reloading", 60, "the reload to begin", interval=0.01)
        wrapper.signal_group(signal.SIGTERM)
        assert wrapper.wait(60) == 0
        thread.join(60)
    # saved by the stop, or by the reload's hand-over the SIGTERM cut short after its commit (the stop then finds
    # the store holds that state: `slots.unchanged`)
    assert [e for e in wrapper.events() if e.get("event") in ("slots.saved", "slots.unchanged") and e["tokens"] > 100]
    assert not [e for e in wrapper.events("child.exited") if e["killed_after_timeout"]]
    with running(tmp_path, argv, config(tmp_path, "never")) as again:
        assert again.status()["slots"]["restore"][0]["outcome"] == "restored"


def test_a_hook_of_another_model_reloads_this_one(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    """The built-in `server.reload`: a second model's on_will_start shrinks the first one's context (as in a
    llama-swap group), with the first wrapper's token from a file; a refused reload fails that hook."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    first_argv = [server_bin, "-m", tiny_path, "-c", "4096", "-np", "1"]
    with running(tmp_path, first_argv, config(tmp_path), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as first:
        turn = complete(first.url, STORY * 20)
        second = f"""
hooks:
  on_will_start:
    - builtin: server.reload
      timeout: 120s
      with: {{url: "{first.url}", token_file: {token_file}, n_ctx: 2048, cache_type_k: q8_0, cache_type_v: q8_0}}
"""
        with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024"], second) as other:
            (run,) = [h for h in other.status()["hooks"] if h["action"] == "server.reload"]
            assert run["outcome"] == "ok" and "n_ctx 2048" in run["detail"], run
        assert first.status()["last_reload"]["n_ctx"] == 2048
        nxt = complete(first.url, STORY * 20 + turn["content"] + " And then")
        assert nxt["timings"]["cache_n"] >= 0.95 * (turn["tokens_evaluated"] + turn["tokens_predicted"])
        refused = second.replace("n_ctx: 2048", "n_ctx: -1")
        failing = Wrapper(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024"], refused)
        assert failing.wait(60) == 3  # a failed on_will_start is a failed start
        assert "n_ctx must be a positive integer" in failing.log_path.read_text()


# -- the context that runs -----------------------------------------------------------------------------------


def reload_cli(wrapper: Wrapper, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "wrapper.cli", "reload", "--url", wrapper.url, *flags],
                          capture_output=True, text=True, timeout=300,
                          env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def ctx_of(wrapper: Wrapper) -> str | None:
    """The -c of the argv that status shows."""
    argv: list[str] = wrapper.status()["server"]["argv"]
    found = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("-c", "--ctx-size")]
    return found[-1] if found else None


def ctx_change(answer: dict[str, Any]) -> str:
    (change,) = [c for c in answer["changes"] if c.startswith(("-c ", "--ctx-size "))]
    return str(change)


def test_a_context_above_the_training_context_is_reported_as_it_runs(tmp_path: Path, server_bin: str,
                                                                    demo_path: str) -> None:
    """The demo model is trained for 8192 tokens and llama-server caps a slot there: a reload to 16384 says
    so, the argv it records says 8192, asking again changes nothing, and a smaller context still reloads."""
    argv = [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"]
    one_slot = config(tmp_path) + "priority: {lane: false}\n"  # one slot, capped (the lane's: the demo's test below)
    with running(tmp_path, argv, one_slot, env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        status, answer = reload(wrapper, {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0"})
        assert status == 200 and answer["success"], answer
        assert answer["n_ctx"] == 8192
        assert ctx_change(answer) == "-c 4096 -> 16384 (asked 16384, runs 8192: the model's training context)"
        assert "asked n_ctx 16384" in answer["message"] and "runs 8192" in answer["message"], answer["message"]
        assert "the model's training context" in answer["message"]
        assert answer["context"] == {"asked": 16384, "runs": 8192, "slot": 8192, "slots": 1,
                                     "why": "the model's training context"}
        state = wrapper.status()
        assert ctx_of(wrapper) == "8192" and state["last_reload"]["changes"] == answer["changes"]
        assert any(note["change"] == "-c 16384 -> 8192" for note in state["argv_changes"]), state["argv_changes"]
        pid = state["server"]["pid"]

        again = reload_cli(wrapper, "--ctx", "16384")
        assert again.returncode == 1, again
        assert "nothing to change: n_ctx 16384 would run 8192 (the model's training context)" in again.stderr, again
        assert wrapper.status()["server"]["pid"] == pid and ctx_of(wrapper) == "8192"

        smaller = reload_cli(wrapper, "--ctx", "4096")
        assert smaller.returncode == 0, smaller
        assert "  -c 8192 -> 4096" in smaller.stdout.splitlines(), smaller.stdout
        assert ctx_of(wrapper) == "4096" and wrapper.status()["server"]["pid"] != pid
        complete(wrapper.url, "Still serving.")


def test_the_demo_s_shared_context_says_what_one_conversation_gets(tmp_path: Path, server_bin: str,
                                                                  demo_path: str) -> None:
    """`make demo`: no -np (four slots on one unified KV). -c 16384 is a pool the four share, each slot capped
    at the training context: the answer says so, and the same ask again is refused as changing nothing."""
    argv = [server_bin, "-m", demo_path, "-c", "8192"]
    with running(tmp_path, argv, config(tmp_path), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        status, answer = reload(wrapper, {"n_ctx": 16384, "cache_type_k": "q8_0", "cache_type_v": "q8_0"})
        assert status == 200 and answer["success"], answer
        assert answer["n_ctx"] == 8192  # what one conversation has (GET /props)
        assert ctx_change(answer) == \
            "-c 8192 -> 16384 (4 slots share 16384, each at most 8192: the model's training context)"
        assert "each conversation at most 8192" in answer["message"], answer["message"]
        assert ctx_of(wrapper) == "16384"
        status, refused = reload(wrapper, {"n_ctx": 16384})
        message = refused["error"]["message"]
        assert status == 400 and message.startswith("nothing to change: -c is 16384 already"), message
        assert "each at most 8192: the model's training context" in message, message


DEGRADE = """
slots: {{dir: {dir}}}
degrade: {{budget: 2GiB}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def test_with_degrade_an_impossible_context_is_reported_as_the_one_that_runs(tmp_path: Path, server_bin: str,
                                                                             demo_path: str) -> None:
    argv = [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"]
    with running(tmp_path, argv, DEGRADE.format(dir=tmp_path / "slots") + "priority: {lane: false}\n",
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:  # one slot: the cap is the slot's
        assert ctx_of(wrapper) == "4096"
        status, answer = reload(wrapper, {"n_ctx": 999999999})
        assert status == 200 and answer["success"], answer
        assert answer["n_ctx"] == 8192
        assert ctx_change(answer) == \
            "-c 4096 -> 999999999 (asked 999999999, runs 8192: the model's training context)", answer["changes"]
        assert "runs 8192" in answer["message"] and "the model's training context" in answer["message"]
        assert ctx_of(wrapper) == "8192" and wrapper.status()["degrade"]["n_ctx"] == 8192
        for ask in (999999999, 16384):
            status, refused = reload(wrapper, {"n_ctx": ask})
            message = refused["error"]["message"]
            assert status == 400 and message.startswith("nothing to change"), message
            assert re.search(r"runs? 8192", message) and "the model's training context" in message, message
        status, answer = reload(wrapper, {"n_ctx": 4096})
        assert status == 200 and answer["success"] and answer["n_ctx"] == 4096, answer
        assert ctx_of(wrapper) == "4096"


async def _chat_stream(url: str, began: asyncio.Event) -> bytes:
    body = {"messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}], "max_tokens": 400,
            "temperature": 0, "stream": True}
    unbounded = aiohttp.ClientTimeout(total=None)  # a busy machine decodes slowly: no 5-minute default
    async with aiohttp.ClientSession(timeout=unbounded) as session, \
            session.post(f"{url}/v1/chat/completions", json=body) as reply:
        assert reply.status == 200
        data = await reply.content.readany()
        began.set()
        return data + await reply.read()


def test_streams_in_flight_are_handed_over_to_the_new_server(tmp_path: Path, server_bin: str,
                                                              demo_path: str) -> None:
    """A reload with overlap pauses the streams instead of waiting for them: each client gets one whole answer."""
    argv = [server_bin, "-m", demo_path, "-c", "2048", "-np", "2"]
    with running(tmp_path, argv, config(tmp_path, "always"), env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        async def scenario() -> tuple[list[bytes], Any]:
            began = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.ensure_future(_chat_stream(wrapper.url, event)) for event in began]
            await asyncio.gather(*(event.wait() for event in began))
            answer = await asyncio.to_thread(reload, wrapper, {"n_ctx": 4096})
            return list(await asyncio.gather(*streams)), answer

        streams, (status, answer) = asyncio.run(scenario())
        assert status == 200 and answer["success"], answer
        assert answer["handed_over"] >= 1, answer  # a stream that ended before the cut is not handed over
        for raw in streams:
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(event) for event in events[:-1]]
            assert not any("error" in chunk for chunk in chunks), chunks[-2:]
            finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
            assert [f for f in finishes if f] == [finishes[-1]] and finishes[-1] in ("stop", "length")
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
            assert len(text) > 40, text
        resumed = wrapper.events("wrapper.stream_resumed")
        assert len(resumed) == answer["handed_over"] and all(e["after"] == "reload" for e in resumed), resumed
        assert wrapper.events("reload.handed_over")[0]["streams"] == answer["handed_over"]
