"""The wrapper in front of the real llama-server with the real default model."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from hooks.store import layout
from tests.helpers import Wrapper, chat_yaml, http, pid_alive, running, wait_for

CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0, "max_tokens": 24,
        "seed": 1, "cache_prompt": False}  # a warm prompt cache changes the numerics: compare cold prefills


def sse_events(raw: bytes) -> list[str]:
    """The data lines of an event stream, checking its framing: `data: ` lines separated by blank lines."""
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == "", "the stream must end with a complete event"
    assert all(block.startswith("data: ") for block in blocks[:-1]), blocks[:3]
    return [block[len("data: "):] for block in blocks[:-1]]


def sse_content(raw: bytes) -> tuple[str, dict[str, int]]:
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    text, usage = "", dict[str, int]()
    for event in events[:-1]:
        chunk = json.loads(event)
        for choice in chunk.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
        usage = chunk.get("usage") or usage
    return text, usage


def test_chat_through_the_wrapper_equals_direct(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """What the proxy owns: the same answers and usage, whole event streams, llama-server's errors unchanged."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "2048", "-np", "1"]) as wrapper:
        direct = wrapper.status()["server"]["url"]
        answers, usages, overflow = {}, {}, {}
        for name, base in (("wrapped", wrapper.url), ("direct", direct)):
            status, _, raw = http("POST", f"{base}/v1/chat/completions", CHAT, timeout=120)
            assert status == 200
            reply = json.loads(raw)
            answers[name], usages[name] = reply["choices"][0]["message"]["content"], reply["usage"]
            streamed = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            status, headers, raw = http("POST", f"{base}/v1/chat/completions", streamed, timeout=120)
            assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
            answers[name + "-stream"], usages[name + "-stream"] = sse_content(raw)
            too_long = {**CHAT, "messages": [{"role": "user", "content": "hi " * 3000}]}
            overflow[name] = http("POST", f"{base}/v1/chat/completions", too_long)
        assert answers["wrapped"] == answers["direct"] and answers["wrapped-stream"] == answers["direct-stream"]
        assert answers["wrapped"].strip()
        assert {k: v for k, v in usages["wrapped"].items() if k != "prompt_tokens_details"} == \
            {k: v for k, v in usages["direct"].items() if k != "prompt_tokens_details"}
        assert usages["wrapped-stream"]["completion_tokens"] == usages["direct-stream"]["completion_tokens"] > 0
        assert overflow["wrapped"][0] == overflow["direct"][0] == 400
        assert json.loads(overflow["wrapped"][2]) == json.loads(overflow["direct"][2])
        assert json.loads(overflow["wrapped"][2])["error"]["type"] == "exceed_context_size_error"
        assert wrapper.stop() == 0


def test_hooks_in_order_and_a_group_sigterm_lets_on_will_stop_reach_the_server(
        tmp_path: Path, server_bin: str, gemma_path: str) -> None:
    log = tmp_path / "hooks.log"
    config = f"""
hooks:
  on_will_start:
    - shell: echo will_start {{{{ model.name }}}} {{{{ model.id }}}} >> {log}
  on_startup:
    - http: {{url: "{{{{ server.url }}}}/props"}}
    - shell: echo startup $LLAMA_SERVER_PID {{{{ slots | length }}}} >> {log}
  on_will_stop:
    - name: last-words
      http:
        url: "{{{{ server.url }}}}/completion"
        json: {{prompt: "Hello", n_predict: 2}}
    - shell: echo will_stop {{{{ slots | length }}}} >> {log}
  on_stopped:
    - shell: echo stopped {{{{ result }}}} {{{{ exit_code }}}} >> {log}
"""
    with Wrapper(tmp_path, [server_bin, "-m", gemma_path, "-c", "1024", "-np", "1"], config) as wrapper:
        wrapper.wait_ready(120)
        status = wrapper.status()
        pid, model_id = status["server"]["pid"], status["model"]["id"]
        wrapper.signal_group(signal.SIGTERM)  # what llama-swap sends to stop a model
        assert wrapper.wait(60) == 0
    assert log.read_text().splitlines() == [
        f"will_start gemma-3-270m-q4_k_m {model_id}", f"startup {pid} 1", "will_stop 1", "stopped success 0"]
    last_words = next(e for e in wrapper.events("hook.run") if e["action"] == "last-words")
    assert last_words["outcome"] == "ok" and last_words["detail"] == "HTTP 200"
    exited = wrapper.events("child.exited")[0]
    assert exited["code"] == 0 and not exited["killed_after_timeout"]
    assert not pid_alive(pid)


def test_a_sigterm_to_the_wrapper_and_its_server_together_does_not_hold_the_stop(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """systemd's default KillMode=control-group sends SIGTERM to every process of the unit: the wrapper and its
    llama-server at once. The server begins its exit ("cleaning up before exit") and answers nothing more, so the
    stop's slots.save (or the hooks' look at the slots) waited for its hook's timeout (40 s with examples/chat.yaml),
    holding the server's exit too. The wrapper reads that line and gives them up at once, saying why, and stops as
    usual."""
    with Wrapper(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"], chat_yaml(tmp_path)) as wrapper:
        wrapper.wait_ready(120)
        http("POST", f"{wrapper.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                            "max_tokens": 4}, timeout=300)
        server = wrapper.status()["server"]["pid"]
        wrapper.process.send_signal(signal.SIGTERM)
        os.kill(server, signal.SIGTERM)
        assert wrapper.wait(120) == 0
    # which comes first is the kernel's choice: the save done before the server's exit began, given up once it
    # began ("exiting by itself": what every run here saw), or refused once it ended —
    # never held until its hook's timeout
    saves = [e for e in wrapper.events("hook.run") if e["action"] == "slots.save"]
    assert saves and all(e["outcome"] == "ok" or "timed out" not in e["detail"] for e in saves), saves
    print("the save:", [(e["outcome"], e["detail"][:60]) for e in saves])
    assert wrapper.events("wrapper.stopped")[0]["exit_status"] == 0


def test_sigkill_of_the_wrapper_leaves_no_llama_server(tmp_path: Path, server_bin: str, gemma_path: str) -> None:
    with Wrapper(tmp_path, [server_bin, "-m", gemma_path, "-c", "1024"]) as wrapper:
        wrapper.wait_ready(120)
        pid = wrapper.status()["server"]["pid"]
        wrapper.signal_group(signal.SIGKILL)  # llama-swap's last resort, to the whole group
        wrapper.wait(10)
        wait_for(lambda: not pid_alive(pid), 10, "llama-server to die with the wrapper")


def test_a_drain_lets_a_stream_finish_and_lands_the_save_then_the_stop_is_quick(
        tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    config = f"""
slots: {{dir: {tmp_path / "slots"}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
    token = "drain-token"
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    with running(tmp_path, argv, config, env={"LLAMA_WRAPPER_ADMIN_TOKEN": token}) as wrapper:
        chunks: list[bytes] = []

        def stream() -> None:
            # ignore_eos: the stream runs its 300 tokens, in flight during the drain, wherever the model would stop
            body = json.dumps({"prompt": "Once upon a time", "n_predict": 300, "ignore_eos": True,
                               "stream": True}).encode()
            request = urllib.request.Request(f"{wrapper.url}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as reply:
                chunks.extend(line for line in reply if line.startswith(b"data:"))

        streaming = threading.Thread(target=stream)
        streaming.start()
        wait_for(lambda: wrapper.status()["requests"]["in_flight"] == 1, 30, "the stream to be in flight")
        answer: list[Any] = []
        draining = threading.Thread(target=lambda: answer.append(http(
            "POST", f"{wrapper.url}/wrapper/drain", {"timeout": "60s"},
            headers={"Authorization": f"Bearer {token}"}, timeout=120)))
        draining.start()
        wait_for(lambda: wrapper.health() == 503, 2, "/health 503 at once")
        assert http("POST", f"{wrapper.url}/completion", {"prompt": "late", "n_predict": 2})[0] == 503
        streaming.join(120)
        draining.join(120)
        assert json.loads(chunks[-1][5:])["stop"] is True  # the stream ran to its end
        status, _, raw = answer[0]
        assert status == 200, raw
        saves = json.loads(raw)["on_will_stop"]
        assert saves[0]["action"] == "slots.save" and saves[0]["detail"].startswith("saved 1 slot(s)")
        folder = next((tmp_path / "slots").iterdir())
        (saved,) = layout.saved_slots(folder)
        assert json.loads(saved.sidecar.read_text())["tokens"] > 300
        began = time.monotonic()
        assert wrapper.stop() == 0
        assert time.monotonic() - began < 1.0
