"""GET /metrics against the real llama-server: its own families passed through, the wrapper's after them,
strictly valid before and after traffic, a restore and a reload; counters only grow; values agree with
/wrapper/status and the log."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from tests import promtext
from tests.helpers import http, running, wait_for

TOKEN = "metrics-token"
CONFIG = """
slots: {{dir: {dir}}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[str, promtext.Family]:
    status, got, body = http("GET", f"{url}/metrics", headers=headers)
    assert status == 200, body[:300]
    assert got["Content-Type"].startswith("text/plain; version=0.0.4")
    return promtext.parse(body.decode())


def grew(before: dict[str, promtext.Family], after: dict[str, promtext.Family]) -> bool:
    old, new = promtext.counters(before), promtext.counters(after)
    return all(new.get(key, 0) >= count for key, count in old.items())


def test_metrics_stay_valid_through_traffic_a_reload_and_a_restore(tmp_path: Path, server_bin: str,
                                                                   tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    config = CONFIG.format(dir=tmp_path / "slots")
    prompt = "The lighthouse keeper counted the ships that passed each night. " * 30
    with running(tmp_path, argv, config, env={"LLAMA_WRAPPER_ADMIN_TOKEN": TOKEN}) as wrapper:
        start = scrape(wrapper.url)
        assert any(name.startswith("llamacpp:") for name in start), sorted(start)  # llama-server's own, passed on
        assert any(n["change"] == "--metrics" for n in wrapper.status()["argv_changes"])
        assert promtext.value(start, "llama_wrapper_starts_total", outcome="ready") == 1
        for _ in range(2):
            assert http("POST", f"{wrapper.url}/completion", {"prompt": prompt, "n_predict": 4})[0] == 200
        traffic = scrape(wrapper.url)
        assert grew(start, traffic)
        assert promtext.value(traffic, "llama_wrapper_requests_total", status_class="2xx") >= 2
        assert promtext.value(traffic, "llamacpp:prompt_tokens_total") > 0
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 4096},
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
        assert status == 200, raw
        reloaded = scrape(wrapper.url)
        assert grew(traffic, reloaded)
        assert promtext.value(reloaded, "llama_wrapper_reloads_total", outcome="success") == \
            len(wrapper.events("reload.done")) == 1
        assert promtext.value(reloaded, "llama_wrapper_reload_downtime_seconds_count") == 1
        assert promtext.value(reloaded, "llama_wrapper_slot_operations_total", operation="save", outcome="saved") == 1
        assert wrapper.stop() == 0
    with running(tmp_path, [*argv[:-4], "-c", "4096", "-np", "1"], config) as wrapper:
        restored = scrape(wrapper.url)
        report = wrapper.status()["slots"]["restore"]
        assert promtext.value(restored, "llama_wrapper_slot_operations_total", operation="restore",
                              outcome="restored") == len([r for r in report if r["outcome"] == "restored"]) == 1
        assert promtext.value(restored, "llama_wrapper_slot_tokens_total", operation="restore") == report[0]["tokens"]
        assert http("POST", f"{wrapper.url}/completion", {"prompt": prompt + " And then", "n_predict": 4})[0] == 200
        reused = wait_for(lambda: wrapper.status()["slots"]["restore"][0]["reused_tokens"], 10, "the reuse")
        after = scrape(wrapper.url)
        assert grew(restored, after)
        assert promtext.value(after, "llama_wrapper_reused_tokens_total") == reused > 0


def test_metrics_ask_for_an_api_key_like_llama_servers_own(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024", "--api-key", "k1"]) as wrapper:
        assert http("GET", f"{wrapper.url}/metrics")[0] == 401
        families = scrape(wrapper.url, {"Authorization": "Bearer k1"})
        assert any(name.startswith("llamacpp:") for name in families)


def test_the_router_gauges_follow_the_queue_and_the_slots(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """One slot: a long answer runs, a second request waits for it; then the KV gauge is what the last answer left
    in the slot over the context."""
    argv = [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"]
    answers: dict[str, dict[str, Any]] = {}

    def complete(name: str, n_predict: int) -> None:
        status, _, raw = http("POST", f"{wrapper.url}/completion", {
            "prompt": f"Story {name}: the lighthouse keeper counted the ships. " * 20, "n_predict": n_predict,
            "temperature": 0, "ignore_eos": True}, timeout=300)
        assert status == 200, raw[:300]
        answers[name] = json.loads(raw)

    def gauges() -> tuple[float, float, float]:
        families = scrape(wrapper.url)
        return (promtext.value(families, "vllm:num_requests_waiting"),
                promtext.value(families, "vllm:num_requests_running"),
                promtext.value(families, "vllm:kv_cache_usage_perc"))

    one_slot = CONFIG.format(dir=tmp_path / "slots") + "priority: {lane: false}\n"  # the second request waits
    with running(tmp_path, argv, one_slot) as wrapper:
        assert gauges() == (0, 0, 0)
        first = threading.Thread(target=complete, args=("A", 400))
        first.start()
        wait_for(lambda: gauges()[1] == 1, 30, "the first request in the slot")
        second = threading.Thread(target=complete, args=("B", 8))
        second.start()
        assert wait_for(lambda: (g := gauges())[0] == 1 and g, 30, "the second one to wait")[1] == 1
        first.join(300)
        second.join(300)
        assert set(answers) == {"A", "B"}
        timings = answers["B"]["timings"]
        left = timings["cache_n"] + timings["prompt_n"] + timings["predicted_n"]
        assert gauges() == (0, 0, left / 4096)
