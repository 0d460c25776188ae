"""Sleep with the real llama-server: idle, the slots are kept and the server stops (its process and memory gone);
the next request wakes it, held with every one arriving meanwhile, and the conversation comes back; a stop, a
reload and a failed wake while asleep; a pool of three where the third fits only if an idle member sleeps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests import pooled
from tests.asking import Asked
from tests.helpers import ROOT, Wrapper, chat, http, pid_alive, running, wait_for

TOKEN = "sleep-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = """
slots: {{dir: {dir}}}
sleep: {{after: {after}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}{will_stop}]
"""
STORY = "The keeper of the northern lighthouse wrote the name of every ship that passed into a ledger. "
FIRST = [{"role": "user", "content": "Remember this story. " + STORY * 30}]  # ~600 tokens


def config(tmp: Path, after: str = "2s", will_stop: str = "") -> str:
    return CONFIG.format(dir=tmp / "slots", after=after, will_stop=will_stop)


def argv(server_bin: str, model: str) -> list[str]:
    return [server_bin, "-m", model, "-c", "4096", "-np", "2"]


def asleep(wrapper: Wrapper, timeout: float = 60) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(lambda: wrapper.status()["state"] == "asleep" and wrapper.status(), timeout,
                                     "the wrapper to fall asleep")
    return found


def next_turn(answer: dict[str, Any], question: str = "Who kept the ledger?") -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": question}]


def history_of(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"])


def test_an_idle_model_sleeps_and_wakes_for_every_held_request_with_its_conversation(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        first = chat(wrapper.url, FIRST, max_tokens=16)
        pid = wrapper.status()["server"]["pid"]
        status = asleep(wrapper)
        assert not pid_alive(pid) and status["server"]["pid"] is None  # the process and its memory are gone
        sleep = status["sleep"]
        assert sleep["asleep"] and sleep["sleeps"] == 1 and "saved 1 slot" in sleep["kept"], sleep
        assert wrapper.health() == 200  # well, and it will serve
        code, _, models = http("GET", f"{wrapper.url}/v1/models")
        assert code == 200 and json.loads(models)["data"][0]["id"], models  # from memory, without waking it
        code, _, props = http("GET", f"{wrapper.url}/props")
        assert code == 200 and "default_generation_settings" in json.loads(props)
        _, _, metrics = http("GET", f"{wrapper.url}/metrics")
        assert b"llama_wrapper_asleep 1.0" in metrics
        assert not wrapper.events("sleep.waking") and wrapper.status()["state"] == "asleep"

        path = "/v1/chat/completions"
        turn = Asked(wrapper.url, path, {"messages": next_turn(first), "max_tokens": 8, "temperature": 0}).start()
        other = Asked(wrapper.url, path, {"messages": [{"role": "user", "content": "Say hello."}],
                                          "max_tokens": 8}).start()
        streamed = Asked(wrapper.url, path, {"messages": [{"role": "user", "content": "Count to five."}],
                                             "max_tokens": 8, "stream": True}).start()
        for each in (turn, other, streamed):
            each.join(120)
            assert each.status == 200 and each.text, (each.status, each.raw[:300])
        assert streamed.events[-1] == {"done": True} and streamed.finals == 1
        assert turn.answer is not None
        assert turn.answer["timings"]["cache_n"] >= 0.95 * history_of(first), turn.answer["timings"]
        (waking,) = wrapper.events("sleep.waking")  # one wake for all three
        assert waking["held"] >= 1
        (woken,) = wrapper.events("sleep.woken")
        assert woken["wake_s"] > 0
        assert wrapper.status()["sleep"]["wakes"] == 1
        asleep(wrapper)  # and asleep again once idle
        assert wrapper.stop() == 0


def test_a_request_arriving_while_it_falls_asleep_is_held_and_answered(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    slow_save = ", {shell: sleep 3}"  # a window to arrive in
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, will_stop=slow_save)) as wrapper:
        chat(wrapper.url, FIRST, max_tokens=8)
        wait_for(lambda: wrapper.status()["state"] == "sleeping", 60, "the wrapper to begin falling asleep")
        answer = chat(wrapper.url, [{"role": "user", "content": "Say hello."}])
        assert answer["choices"][0]["message"]["content"]
        assert wrapper.events("sleep.asleep") and wrapper.events("sleep.woken")
        assert wrapper.status()["state"] in ("ready", "sleeping")
        assert wrapper.stop() == 0


def test_a_stop_while_asleep_loses_nothing(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path)) as wrapper:
        first = chat(wrapper.url, FIRST, max_tokens=16)
        asleep(wrapper)
        assert wrapper.stop() == 0
        (stopped,) = wrapper.events("wrapper.stopped")
        assert stopped["result"] == "success"
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, after="off")) as again:
        turn = chat(again.url, next_turn(first))
        assert turn["timings"]["cache_n"] >= 0.95 * history_of(first), turn["timings"]
        assert again.stop() == 0


def test_a_reload_while_asleep_is_applied_at_the_wake(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        first = chat(wrapper.url, FIRST, max_tokens=16)
        asleep(wrapper)
        code, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 3072}, headers=ADMIN)
        answer = json.loads(raw)
        assert code == 200 and answer["at_wake"] and answer["success"], answer
        token = tmp_path / "token"
        token.write_text(TOKEN)
        told = subprocess.run([sys.executable, "-m", "wrapper.cli", "reload", "--url", wrapper.url, "--token-file",
                               str(token), "--ctx", "3072"], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert told.returncode == 0 and "when the next request wakes" in told.stdout, (told.stdout, told.stderr)
        status = wrapper.status()
        assert status["state"] == "asleep" and status["sleep"]["reload_at_wake"], status["sleep"]
        turn = chat(wrapper.url, next_turn(first))
        assert "3072" in wrapper.status()["server"]["argv"]
        assert turn["timings"]["cache_n"] >= 0.95 * history_of(first), turn["timings"]
        assert wrapper.status()["sleep"]["reload_at_wake"] is None
        assert wrapper.stop() == 0


def test_sleep_and_wake_asked_by_a_scheduler(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    with running(tmp_path, argv(server_bin, demo_path), config(tmp_path, after="off"),
                 env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        first = chat(wrapper.url, FIRST, max_tokens=16)
        assert http("POST", f"{wrapper.url}/wrapper/sleep")[0] == 401  # the admin token
        code, _, raw = http("POST", f"{wrapper.url}/wrapper/sleep", headers=ADMIN, timeout=60)
        assert code == 200 and json.loads(raw)["asleep"], raw
        assert wrapper.status()["state"] == "asleep"
        code, _, raw = http("POST", f"{wrapper.url}/wrapper/wake", headers=ADMIN, timeout=120)
        assert code == 200 and json.loads(raw)["woken"], raw
        assert wrapper.status()["state"] == "ready"
        turn = chat(wrapper.url, next_turn(first))
        assert turn["timings"]["cache_n"] >= 0.95 * history_of(first), turn["timings"]
        assert wrapper.stop() == 0


def test_a_wake_that_fails_answers_503_and_the_next_request_tries_again(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(Path(demo_path).read_bytes())
    with running(tmp_path, argv(server_bin, str(model)), config(tmp_path)) as wrapper:
        first = chat(wrapper.url, FIRST, max_tokens=16)
        asleep(wrapper)
        model.rename(tmp_path / "away.gguf")  # the model's disk is gone for a while
        code, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 4}, timeout=120)
        assert code == 503 and b"could not wake" in raw, raw
        assert wrapper.status()["state"] == "asleep" and wrapper.status()["sleep"]["last_wake_error"]
        assert wrapper.events("sleep.wake_failed") and wrapper.health() == 200
        (tmp_path / "away.gguf").rename(model)
        turn = chat(wrapper.url, next_turn(first))
        assert turn["timings"]["cache_n"] >= 0.95 * history_of(first), turn["timings"]
        wrapper.signal_group(signal.SIGTERM)
        assert wrapper.wait(60) == 0


POOL_CONFIG = """
slots: {{dir: {slots}}}
sleep: {{when_asked: 1s}}
degrade: {{pool: {pool}, budget: {total}, context: 1024, relax_after: 3s, pool_wait: 120s, ladder: []}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""
HUGE = "A long report from the archive of the harbour office, to be summarised. " + STORY * 190  # ~3.5k tokens


def test_a_pool_of_three_where_the_third_fits_only_if_an_idle_member_sleeps(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    plain = [server_bin, "-m", demo_path, "-np", "1"]
    rest, huge = pooled.share_of(plain, 1024), pooled.share_of(plain, 4096)
    total = 3 * rest + (huge - rest) // 4  # the ladders give context down to 256 each: not enough for the third
    pool = tmp_path / "pool"
    members = {name: Wrapper(tmp_path, plain, POOL_CONFIG.format(slots=tmp_path / f"slots-{name}", pool=pool,
                                                                  total=total))
               for name in ("first", "second", "third")}
    try:
        for each in members.values():
            each.wait_ready(180)
        first = chat(members["first"].url, FIRST, max_tokens=16)  # the first's conversation, then it idles
        # a member's record learns its idleness by a look every 0.2 s: a request shorter than that may go unseen, its
        # member then idle since its start (CI once saw the second, whose one short request went unseen, chosen as
        # the longest idle). The second's request is long enough to be seen, and the third asks once it is.
        chat(members["second"].url, [{"role": "user", "content": "Say hello, then count to thirty."}],
             max_tokens=48, ignore_eos=True)  # the second idles less long
        pids = {name: members[name].process.pid for name in ("first", "second")}

        def idle_since(name: str) -> float:
            return max((float(r["idle_since"]) for r in pooled.records(pool) if r["pid"] == pids[name]), default=0.0)

        wait_for(lambda: idle_since("second") > idle_since("first") > 0, 30, "the second's request on its record")
        wait_for(lambda: all(r["idle_since"] and time.time() - r["idle_since"] > 1.5 for r in pooled.records(pool)),
                 30, "every member idle for its sleep.when_asked")
        status, long_answer = pooled.chat(members["third"].url, [{"role": "user", "content": HUGE}])
        assert status == 200, long_answer
        assert long_answer["timings"]["prompt_n"] > 3000
        assert members["first"].status()["state"] == "asleep"  # the longest idle slept, and gave its share
        assert members["second"].status()["state"] == "ready"
        asked = [m for m in pooled.memory(members["third"])["pool"]["moves"] if any(
            g["what"] == "fell asleep" for g in m["givers"])]
        assert asked, pooled.memory(members["third"])["pool"]["moves"]
        assert pooled.records_sum(pool) <= total
        shown = [r for r in pooled.records(pool) if r.get("asleep")]
        assert len(shown) == 1 and shown[0]["share"] == 0
        # its next turn wakes it (asking the others, who are idle now) and its conversation comes back
        turn = chat(members["first"].url, next_turn(first), max_tokens=8)
        assert turn["timings"]["cache_n"] >= 0.95 * history_of(first), turn["timings"]
        assert members["first"].events("sleep.woken")
        assert pooled.records_sum(pool) <= total
    finally:
        for each in members.values():
            each.kill()
