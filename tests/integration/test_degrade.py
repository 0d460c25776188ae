"""Degradation under a memory budget against the real llama-server: the planner's figures, growth on demand
with the same request answered, continuation, budget changes and relaxing, nothing lost on the way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hooks.degrade.calibration import Measured
from hooks.degrade.memory import Choices, MiB, largest_ctx, plan, read_shape
from tests.helpers import ROOT, Wrapper, http, running, wait_for

TOKEN = "degrade-token-1c9e"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
STORY = "The lighthouse keeper counted the ships that passed the northern cape each night. "
CONFIG = """
slots: {{dir: {dir}}}
degrade: {{budget: {budget}, relax_after: {relax}, headroom: {headroom}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def config(tmp_path: Path, budget: int, relax: str = "10m", headroom: int = 256) -> str:
    return CONFIG.format(dir=tmp_path / "slots", budget=budget, relax=relax, headroom=headroom)


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, raw = http("POST", f"{url}{path}", body, timeout=600, headers=headers)
    return status, json.loads(raw)


def complete(url: str, prompt: str, slot: int = 0, n_predict: int = 4, stream: bool = False) -> dict[str, Any]:
    """A /completion on a pinned slot; streamed answers are read to their last event."""
    status, raw = post_raw(url, {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True,
                                 "id_slot": slot, "stream": stream})
    assert status == 200, raw[:500]
    if not stream:
        return dict(json.loads(raw))
    events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
    return {**events[-1], "content": "".join(e.get("content", "") for e in events)}


def post_raw(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    status, _, raw = http("POST", f"{url}/completion", body, timeout=600)
    return status, raw


def degrade_status(wrapper: Wrapper) -> dict[str, Any]:
    result: dict[str, Any] = wrapper.status()["degrade"]
    return result


# -- the planner against the server's own lines --------------------------------------------------------------


def server_buffers(server_bin: str, argv: list[str]) -> Measured:
    """Start llama-server at verbosity 4 until it has reported its buffers, then stop it."""
    process = subprocess.Popen([server_bin, *argv, "--port", "0", "-lv", "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    measured = Measured()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            measured.feed(line)
            if measured.done:
                break
    finally:
        process.kill()
        process.wait(30)
    assert measured.done, "llama-server never reported its compute buffer"
    return measured


@pytest.mark.parametrize("model", ["demo", "gemma"])
def test_the_plan_matches_what_the_server_allocates(server_bin: str, demo_path: str, gemma_path: str,
                                                    model: str) -> None:
    """KV and model buffers within 1 % of the server's own lines, the total within 5 %: 3 contexts x 3 types."""
    path = demo_path if model == "demo" else gemma_path
    shape = read_shape(path)
    for n_ctx in (4096, 16384, 32768):
        for kind in ("f16", "q8_0", "q4_0"):
            measured = server_buffers(server_bin, ["-m", path, "-c", str(n_ctx), "-ctk", kind, "-ctv", kind,
                                                   "-np", "1", "-kvu", "--swa-full"])
            planned = plan(shape, Choices(n_ctx=n_ctx, type_k=kind, type_v=kind, swa_full=True)).devices["CPU"]
            seen = measured.devices["CPU"]
            what = f"{model} -c {n_ctx} {kind}"
            assert planned["kv"] == pytest.approx(seen["kv"], rel=0.01), what
            assert planned["weights"] == pytest.approx(seen["weights"], rel=0.01), what
            assert sum(planned.values()) == pytest.approx(sum(seen.values()), rel=0.05), what


# -- growth ------------------------------------------------------------------------------------------------


def gemma_budget(path: str) -> int:
    """A budget under which f16 fits about 5k tokens and q4_0 15k (the sliding window kept full, two slots)."""
    shape = read_shape(path)
    at_15k = Choices(n_ctx=15104, type_k="q4_0", type_v="q4_0", swa_full=True, n_parallel=2)
    budget = plan(shape, at_15k).total() + MiB
    assert 4096 <= largest_ctx(shape, Choices(n_ctx=0, swa_full=True, n_parallel=2), budget, 32768) < 8192
    return budget


def test_a_conversation_grows_from_2k_to_14k_tokens_without_an_error(tmp_path: Path, server_bin: str,
                                                                     gemma_path: str) -> None:
    """Under a budget where f16 holds ~5k tokens and only q4_0 holds 14k: each overflowing turn is answered
    after a growth (one streamed), the history is reused after each reload, 8 clients during a growth are
    all answered, and the rungs show in status and in the log."""
    argv = [server_bin, "-m", gemma_path, "-np", "2"]
    with running(tmp_path, argv, config(tmp_path, gemma_budget(gemma_path)), timeout=180,
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        assert degrade_status(wrapper)["rung"] == "as-given"
        history, previous, rungs_seen, per_char = "", 0, ["as-given"], 0.2
        for turn, target in enumerate((2000, 5000, 8000, 11000, 14000)):
            while len(history) * per_char < target:
                history += STORY
            before = degrade_status(wrapper)["rung"]
            answers: list[int] = []

            def hello(i: int, answers: list[int] = answers) -> None:
                answers.append(post_raw(wrapper.url, {"prompt": f"Client {i} says hello.", "n_predict": 4,
                                                      "id_slot": 1, "stream": True})[0])

            clients = [threading.Thread(target=hello, args=(i,)) for i in range(8)]
            if turn == 2:
                for client in clients:
                    client.start()
            result = complete(wrapper.url, history, stream=turn == 3)
            for client in clients:
                if client.is_alive() or turn == 2:
                    client.join(300)
            if turn == 2:
                assert answers == [200] * 8
            rung = degrade_status(wrapper)["rung"]
            if rung != before:
                rungs_seen.append(rung)
                # the turn after a reload: the conversation so far came back from the slot file
                assert result["timings"]["cache_n"] >= 0.9 * previous, (turn, result["timings"], previous)
            previous = result["timings"]["cache_n"] + result["timings"]["prompt_n"] + result["timings"]["predicted_n"]
            per_char = result["tokens_evaluated"] / len(history)  # this tokenizer's tokens per character
            history += result["content"]
        assert previous > 13000
        assert rungs_seen[0] == "as-given" and rungs_seen[-1] == "quantize-kv-q4" and len(rungs_seen) >= 3
        steps = degrade_status(wrapper)["steps"]
        assert all(step["success"] for step in steps) and len(steps) == len(rungs_seen) - 1
        logged = [e["rung"] for e in wrapper.events("degrade.step")]
        assert logged == rungs_seen[1:]
        memory = json.loads(http("GET", f"{wrapper.url}/wrapper/memory")[2])
        assert memory["rung"] == "quantize-kv-q4" and memory["measured"]["complete"]
        assert memory["planned"]["bytes"]["kv"] == pytest.approx(memory["measured"]["devices"]["CPU"]["kv"], rel=0.01)
        assert memory["planned"]["bytes"]["total"] <= memory["budget"]["bytes"]


def test_what_no_rung_can_hold_is_a_400_that_says_why(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048)).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "1"], config(tmp_path, budget)) as wrapper:
        status, answer = post(wrapper.url, "/completion", {"prompt": STORY * 700, "n_predict": 4})
        assert status == 400 and answer["error"]["type"] == "exceed_context_size_error"
        assert "the largest context under the memory budget" in answer["error"]["message"]
        assert answer["error"]["n_prompt_tokens"] > 8192
        status, answer = post(wrapper.url, "/completion", {"prompt": "Still here?", "n_predict": 2})
        assert status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_cut_by_a_full_context_is_continued(tmp_path: Path, server_bin: str, demo_path: str,
                                                          stream: bool) -> None:
    """The context fills during the answer: the wrapper grows it and goes on; the client sees one answer with
    every token it asked for (streamed: one role chunk, one finish, one [DONE], the prefix not repeated).
    ignore_eos: the answer runs to its limit wherever the model would have stopped (which depends on the CPU)."""
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048)).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "1"], config(tmp_path, budget)) as wrapper:
        n_ctx = degrade_status(wrapper)["n_ctx"]
        text = "Count on: one two three four five six seven eight nine ten " * 150
        asked = {"messages": [{"role": "user", "content": text}], "max_tokens": n_ctx // 3, "temperature": 0,
                 "ignore_eos": True, "stream": stream}
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions", asked, timeout=600)
        assert status == 200, raw[:300]
        if stream:
            events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            chunks = [json.loads(e) for e in events[:-1]]
            deltas = [c["choices"][0]["delta"] for c in chunks]
            assert sum("role" in d for d in deltas) == 1
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
            generated = sum(1 for d in deltas if d.get("content"))  # one token per delta from llama-server
            prompt = json.loads(http("POST", f"{wrapper.url}/tokenize", {"content": text})[2])["tokens"]
            assert len(prompt) < n_ctx < len(prompt) + generated  # it went past the first context
            assert generated == n_ctx // 3
        else:
            answer = json.loads(raw)
            usage = answer["usage"]
            assert usage["prompt_tokens"] < n_ctx < usage["total_tokens"]  # it went past the first context
            assert usage["completion_tokens"] == n_ctx // 3
            assert answer["choices"][0]["finish_reason"] == "length"
        assert wrapper.events("degrade.continue") and degrade_status(wrapper)["rung"] != "as-given"


# -- budget changes and relaxing -------------------------------------------------------------------------------


def test_a_smaller_budget_degrades_a_running_server_and_a_larger_one_brings_it_back(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    shape = read_shape(demo_path)
    small = plan(shape, Choices(n_ctx=2048, type_k="q4_0", type_v="q4_0")).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "2"], config(tmp_path, 400 * MiB),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        assert degrade_status(wrapper)["n_ctx"] == 8192
        history = STORY * 90
        first = complete(wrapper.url, history)
        tokens = first["tokens_evaluated"] + first["tokens_predicted"]
        assert post(wrapper.url, "/wrapper/budget", {"budget": "1GiB"})[0] == 401
        statuses: list[int] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                statuses.append(post_raw(wrapper.url, {"prompt": "Short one.", "n_predict": 2, "id_slot": 1})[0])

        thread = threading.Thread(target=client)
        thread.start()
        status, answer = post(wrapper.url, "/wrapper/budget", {"budget": small}, ADMIN)
        stop.set()
        thread.join(120)
        assert status == 200 and answer["reloaded"] and answer["rung"] != "as-given", answer
        assert statuses and set(statuses) == {200}
        nxt = complete(wrapper.url, history + first["content"] + " And then")
        assert nxt["timings"]["cache_n"] >= 0.9 * tokens
        status, answer = post(wrapper.url, "/wrapper/budget", {"budget": "400MiB"}, ADMIN)
        assert status == 200 and answer["rung"] == "as-given" and answer["n_ctx"] == 8192
        status, answer = post(wrapper.url, "/wrapper/budget", {"budget": "lots"}, ADMIN)
        assert status == 400 and "not a size" in answer["error"]["message"]


def test_a_refused_budget_leaves_growth_as_it_was(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """A budget that holds no rung is refused, and nothing of it stays: the ladder, the budget and where it came
    from are as before, and the next growth chooses from the same rungs (it once chose from the refused plan)."""
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048)).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "1"], config(tmp_path, budget),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        shown = [e["line"] for e in wrapper.events("server.output")]  # info only: -lv 4's extra lines are debug
        assert len(shown) < 40 and not [line for line in shown if "print_info:" in line], len(shown)
        assert wrapper.events("degrade.measured")  # the planner still read them
        fitted = next(n["change"] for n in wrapper.events("argv.rewritten") if n["change"].startswith("degrade: rung"))
        assert "-c 8192 -> " in fitted  # the context the budget allows, said as the argv change it is
        before = degrade_status(wrapper)
        status, answer = post(wrapper.url, "/wrapper/budget", {"budget": "40MiB"}, ADMIN)
        assert status == 400 and "the budget is unchanged" in answer["error"]["message"], answer
        after = degrade_status(wrapper)
        for key in ("budget", "budget_source", "ladder", "rung", "n_ctx"):
            assert after[key] == before[key], key
        long = complete(wrapper.url, STORY * 200)  # ~3.4k tokens: past f16's 2k, a growth
        assert long["timings"]["prompt_n"] > 2048
        needed = long["timings"]["prompt_n"] + long["timings"]["cache_n"] + 4  # the prompt and its n_predict
        expected = next(r["name"] for r in before["ladder"] if "skipped" not in r and r["max_ctx"] >= needed)
        assert degrade_status(wrapper)["rung"] == expected
        status, answer = post(wrapper.url, "/wrapper/budget", {"budget": "1GiB", "budgte": 1}, ADMIN)
        assert status == 400 and "unknown field(s) budgte" in answer["error"]["message"], answer
        status, answer = post(wrapper.url, "/wrapper/budget", {}, ADMIN)
        assert status == 400 and 'give {"budget": SIZE}' in answer["error"]["message"], answer


def test_an_idle_server_relaxes_back_up(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048)).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "1"], config(tmp_path, budget, relax="3s")) as wrapper:
        complete(wrapper.url, STORY * 200)  # ~3k tokens: grows past f16's 2k
        assert degrade_status(wrapper)["rung"] != "as-given"
        complete(wrapper.url, "A short new conversation.")  # the long one is gone from the slot
        relaxed = wait_for(lambda: [s for s in degrade_status(wrapper)["steps"] if s["why"].startswith("relax")],
                           60, "the wrapper to relax")
        assert len(relaxed) == 1 and relaxed[0]["success"] and relaxed[0]["rung"] == "as-given", relaxed
        assert degrade_status(wrapper)["rung"] == "as-given"


def test_without_degrade_its_endpoints_say_so(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024"],
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        status, _, raw = http("GET", f"{wrapper.url}/wrapper/memory")
        assert status == 409 and "degrade" in json.loads(raw)["error"]["message"]
        assert post(wrapper.url, "/wrapper/budget", {"budget": "1GiB"}, ADMIN)[0] == 409
        assert "degrade" not in wrapper.status()


def test_a_restart_starts_on_a_rung_that_holds_the_saved_conversation(tmp_path: Path, server_bin: str,
                                                                       demo_path: str) -> None:
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048)).total() + MiB
    argv = [server_bin, "-m", demo_path, "-np", "1"]
    history = STORY * 200  # ~3.4k tokens: past f16's 2k
    with running(tmp_path, argv, config(tmp_path, budget)) as wrapper:
        first = complete(wrapper.url, history)
        grown = degrade_status(wrapper)["rung"]
        assert grown != "as-given"
        assert wrapper.stop() == 0
    with running(tmp_path, argv, config(tmp_path, budget)) as again:
        assert degrade_status(again)["rung"] == grown  # as-given could not restore it
        assert again.status()["slots"]["restore"][0]["outcome"] == "restored"
        nxt = complete(again.url, history + first["content"] + " And then")
        assert nxt["timings"]["cache_n"] >= 0.9 * (first["tokens_evaluated"] + first["tokens_predicted"])


def test_overflows_at_once_cause_one_reload(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Three clients overflow the context together (two slots, a third queued): one growth, three answers."""
    shape = read_shape(demo_path)
    budget = plan(shape, Choices(n_ctx=2048, n_parallel=2)).total() + MiB
    with running(tmp_path, [server_bin, "-m", demo_path, "-np", "2"], config(tmp_path, budget)) as wrapper:
        answers: list[int] = []

        def long_one(i: int) -> None:
            answers.append(post_raw(wrapper.url, {"prompt": f"Client {i}. " + STORY * 140, "n_predict": 4})[0])

        clients = [threading.Thread(target=long_one, args=(i,)) for i in range(3)]
        for client in clients:
            client.start()
        for client in clients:
            client.join(600)
        assert answers == [200, 200, 200]
        steps = degrade_status(wrapper)["steps"]
        assert len(steps) == 1 and steps[0]["success"] and steps[0]["why"].startswith("grow"), steps
        assert len(wrapper.events("reload.done")) == 1


def test_plan_prints_the_ladder_without_a_server(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    def plan_cli(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "wrapper.cli", "plan", *options, "--", server_bin,
                               "--model", demo_path], capture_output=True, text=True, check=False, cwd=ROOT,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path), "HOME": str(tmp_path)})

    table = plan_cli("--budget", "200MiB")
    assert table.returncode == 0, table.stderr
    assert "as-given" in table.stdout and "quantize-kv-q4" in table.stdout and "skipped: no mmproj" in table.stdout
    assert "on the CPU (--budget)" in table.stdout  # not degrade.budget: there is no config
    report = json.loads(plan_cli("--budget", "200MiB", "--json").stdout)
    shape = read_shape(demo_path)
    assert report["current"]["bytes"]["kv"] == plan(shape, Choices(n_ctx=8192)).component("kv")
    assert report["budget"]["source"] == "--budget"
    rungs = {r["name"]: r for r in report["rungs"]}
    assert 0 < rungs["as-given"]["max_ctx"] < rungs["quantize-kv-q8"]["max_ctx"] <= 8192
    assert all(r["bytes"]["total"] <= 200 * MiB for r in report["rungs"] if "bytes" in r)
    example = plan_cli("--config", str(ROOT / "examples" / "degrade.yaml"))  # it names an admin token: not needed
    assert example.returncode == 0 and "(degrade.budget)" in example.stdout, example.stderr
    nothing = plan_cli("--budget", "1MiB")
    assert nothing.returncode == 1 and "holds no rung of the ladder" in nothing.stdout
    assert plan_cli("--budget", "lots").returncode == 2
