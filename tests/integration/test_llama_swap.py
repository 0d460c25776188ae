"""The wrapper as the `cmd` of the real llama-swap (the pinned tag, built from third_party/), run with the recipe's
config: examples/llama-swap.yaml, `chat` the demo model and `task` Gemma 3 270M, each wrapper with examples/chat.yaml
(docs/recipes/llama-swap.md). A conversation survives a swap, an unload and a TTL; a group runs both models at once
on one memory pool; streams, /upstream and /v1/models pass through, and a client that hangs up stops its
generation; a SIGKILL of llama-server or of the wrapper costs no conversation; llama-swap's own SIGTERM saves every
model and leaves nothing running."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import swap
from tests.helpers import http, pid_alive, wait_for
from tests.swap import Conversation, LlamaSwap

STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
LEDGER = "Remember this ledger. " + STORY * 60  # ~1.1k tokens: more than cache.checkpoint_tokens (1024)
TALE = [{"role": "user", "content": "Tell me a long tale about a lighthouse keeper."}]
REUSED = 0.9  # the share of a turn's prompt that must come from the cache after a swap, an unload, a crash


@pytest.fixture
def settings(server_bin: str, demo_path: str, gemma_path: str) -> dict[str, Any]:
    """The recipe's config pointed here; llama-swap's own debug lines say how each process ended ("process
    exited cleanly", or "stopped by llama-swap: signal: killed" once an unloadTimeout ran out)."""
    return {**swap.config(server_bin, demo_path, gemma_path), "logLevel": "debug"}


def ended_cleanly(swap_: LlamaSwap, model: str) -> int:
    """How many of `model`'s processes exited on their own (status 0) after llama-swap's SIGTERM."""
    return swap_.log().count(f"<{model}> process exited cleanly")


def predicted(server: str) -> float:
    """llama-server's own count of the tokens it generated (its /metrics: cancelled generations count too)."""
    return _metric(server, "llamacpp:tokens_predicted_total")


def processing(server: str) -> float:
    return _metric(server, "llamacpp:requests_processing")


def _metric(server: str, name: str) -> float:
    text = http("GET", f"{server}/metrics")[2].decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found is not None, text[:500]
    return float(found.group(1))


def test_a_swap_away_and_back_reuses_the_conversation(tmp_path: Path, llama_swap_bin: str,
                                                       settings: dict[str, Any]) -> None:
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        chat = Conversation(ls, "chat")
        chat.turn(LEDGER)
        assert ls.running() == {"chat": "ready"}
        first = ls.wrapper_pid("chat")
        Conversation(ls, "task").turn("Say hello.")  # llama-swap swaps chat out: its wrapper saves, then exits
        assert ls.running() == {"task": "ready"} and not pid_alive(first)
        assert ls.listed() == {"chat": "unloaded", "task": "loaded"}
        chat.turn("Who wrote the names?")  # and back: chat starts again, restores, then answers
        assert chat.reused[-1] >= REUSED, chat.reused
        assert ls.wrapper_pid("chat") != first
        restored = ls.events("slots.restored")[-1]
        assert restored["tokens"] >= chat.answers[0]["usage"]["prompt_tokens"], restored
        assert [e["result"] for e in ls.events("wrapper.stopped")] == ["success", "success"]  # chat, then task
        assert ended_cleanly(ls, "chat") == 1 and ended_cleanly(ls, "task") == 1


def test_an_unload_and_a_ttl_save_inside_unload_timeout_and_the_next_turn_restores(
        tmp_path: Path, llama_swap_bin: str, settings: dict[str, Any]) -> None:
    settings["models"]["task"]["ttl"] = 3  # the test's: task unloads 3 s after its last request
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        chat = Conversation(ls, "chat")
        chat.turn(LEDGER)
        wrapper = ls.wrapper_pid("chat")
        status, _, raw = http("POST", f"{ls.url}/api/models/unload/chat", timeout=120)
        assert status == 200, raw
        assert ls.running() == {} and not pid_alive(wrapper)  # it answers once the process has exited
        stopped = ls.events("wrapper.stopped")[-1]
        assert stopped["result"] == "success" and stopped["exit_status"] == 0, stopped
        assert stopped["budget_hint_s"] == settings["models"]["chat"]["unloadTimeout"]  # chat.yaml's stop_budget
        assert ended_cleanly(ls, "chat") == 1 and "signal: killed" not in ls.log()
        chat.turn("Who wrote the names?")
        assert chat.reused[-1] >= REUSED, chat.reused

        task = Conversation(ls, "task")
        task.turn("Remember this other ledger. " + STORY * 50)  # chat is swapped out meanwhile
        wait_for(lambda: "task" not in ls.running(), 60, "task's TTL to unload it", interval=0.2)
        assert "<task> Unloading model, TTL of 3s reached" in ls.log()
        assert ended_cleanly(ls, "task") == 1 and "signal: killed" not in ls.log()
        assert ls.events("wrapper.stopped")[-1]["result"] == "success"
        task.turn("Who wrote the names?")
        assert task.reused[-1] >= REUSED, task.reused


def test_a_group_runs_both_at_once_on_one_pool_and_llama_swaps_sigterm_saves_both(
        tmp_path: Path, llama_swap_bin: str, server_bin: str, demo_path: str, gemma_path: str) -> None:
    """The recipe's group (`swap: false`) and its pool block added to examples/chat.yaml, as it tells a user."""
    wrapper_config = tmp_path / "chat-pool.yaml"
    wrapper_config.write_text(yaml.safe_dump({**yaml.safe_load(swap.WRAPPER_CONFIG.read_text()),
                                              **swap.recipe_block("# one pool for both")}))
    settings = {**swap.config(server_bin, demo_path, gemma_path, wrapper_config),
                **swap.recipe_block("# both at once"), "logLevel": "debug"}
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        chat, task = Conversation(ls, "chat"), Conversation(ls, "task")
        chat.turn(LEDGER)
        first = ls.wrapper_pid("chat")
        task.turn("Say hello.")
        assert ls.running() == {"chat": "ready", "task": "ready"} and ls.wrapper_pid("chat") == first
        pools = [json.loads(http("GET", f"{ls.wrapper_url(model)}/wrapper/memory")[2])["pool"]
                 for model in ("chat", "task")]
        assert pools[0]["total"] == pools[1]["total"] > 0, pools
        for pool in pools:  # one pool, its members the two wrappers
            assert {member["pid"] for member in pool["members"]} == {first, ls.wrapper_pid("task")}, pool
            assert sum(member["share"] for member in pool["members"]) <= pool["total"], pool
        chat.turn("Who wrote the names?")
        assert chat.reused[-1] >= REUSED, chat.reused  # its slot, never left
        assert ls.wrapper_pid("chat") == first

        ls.processes()  # what runs below llama-swap: both wrappers and their llama-servers
        assert ls.stop() == 0
        assert not ls.left_running()
        after = ls.log().split("received signal terminated", 1)[1]
        stops = [json.loads(line) for line in after.splitlines() if '"event": "wrapper.stopped"' in line]
        assert [s["result"] for s in stops] == ["success", "success"], stops
        assert '"slots.save_failed"' not in after and "signal: killed" not in after
        assert ended_cleanly(ls, "chat") == 1 and ended_cleanly(ls, "task") == 1
        folders = list((ls.home / ".cache" / "llama-wrapper" / "slots").iterdir())
        assert len(folders) == 2 and all(any(folder.glob("*.bin")) for folder in folders), folders


def test_a_stream_upstream_models_and_a_client_that_hangs_up(tmp_path: Path, llama_swap_bin: str,
                                                               settings: dict[str, Any]) -> None:
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        with ls.stream("chat", [{"role": "user", "content": "Name three colours."}], 32) as streamed:
            assert streamed.reply.getheader("Content-Type", "").startswith("text/event-stream")
            streamed.read_to_end()
        assert streamed.done == 1 and streamed.finishes == 1 and streamed.text.strip(), streamed.events[-3:]

        status, _, raw = http("GET", f"{ls.url}/upstream/chat/wrapper/status")
        assert status == 200 and json.loads(raw)["server"]["pid"] == ls.server_pid("chat"), raw[:300]
        assert ls.listed() == {"chat": "loaded", "task": "unloaded"}

        server = ls.status("chat")["server"]["url"]
        before = predicted(server)
        with ls.stream("chat", TALE, 2000, ignore_eos=True) as hung:
            for _ in range(5):
                assert hung.next_content()
        # the client has hung up: the wrapper ends the generation, llama-server stops long before 2,000 tokens
        wait_for(lambda: ls.status("chat")["requests"]["in_flight"] == 0, 120, "the wrapper to let the request go")
        wait_for(lambda: processing(server) == 0, 120, "llama-server to stop generating")
        assert 5 <= predicted(server) - before < 2000
        assert swap.DISCONNECTED in ls.log()  # llama-swap's words for a client that hung up, too
        answer = ls.chat("chat", [{"role": "user", "content": "Say hi."}])
        assert answer["choices"][0]["message"]["content"].strip()
        assert ls.running() == {"chat": "ready"}


def test_a_sigkill_of_llama_server_under_a_stream_through_llama_swap_is_one_whole_answer(
        tmp_path: Path, llama_swap_bin: str, settings: dict[str, Any]) -> None:
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        Conversation(ls, "chat").turn("Say hello.")  # loaded before the stream, so the kill meets a served stream
        killed = ls.server_pid("chat")
        with ls.stream("chat", TALE, 120) as streamed:
            for _ in range(20):
                assert streamed.next_content()
            os.kill(killed, signal.SIGKILL)
            streamed.read_to_end()
        assert streamed.done == 1 and streamed.finishes == 1, streamed.events[-3:]
        assert len(streamed.text) > 40
        restarts = ls.status("chat")["restarts"]
        assert restarts["count"] == 1 and "SIGKILL" in restarts["last"]["why"], restarts
        assert ls.server_pid("chat") != killed
        log = ls.log()
        assert swap.DISCONNECTED not in log and "exited unexpectedly" not in log
        assert ls.running() == {"chat": "ready"}


def test_a_sigkill_of_the_wrapper_llama_swap_starts_it_again_and_the_conversation_comes_back_from_disk(
        tmp_path: Path, llama_swap_bin: str, settings: dict[str, Any]) -> None:
    with LlamaSwap(tmp_path, llama_swap_bin, settings) as ls:
        chat = Conversation(ls, "chat")
        chat.turn(LEDGER)
        wait_for(lambda: ls.events("conversations.checkpoint"), 60, "the conversation kept (a checkpoint)",
                 interval=0.2)
        wrapper, server = ls.wrapper_pid("chat"), ls.server_pid("chat")
        os.kill(wrapper, signal.SIGKILL)
        wait_for(lambda: "chat" not in ls.running(), 30, "llama-swap to see its cmd die", interval=0.1)
        assert "<chat> upstream process exited unexpectedly" in ls.log()
        wait_for(lambda: not pid_alive(server), 10, "llama-server to die with its wrapper")
        chat.turn("Who wrote the names?")  # llama-swap starts chat again; the wrapper restores the checkpoint
        assert chat.reused[-1] >= REUSED, chat.reused
        assert ls.wrapper_pid("chat") != wrapper
