"""GET /metrics: the wrapper's families in a strictly valid text, against a tiny real child (no llama-server
metrics to pass through here: the child's --help has no --metrics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import promtext
from tests.helpers import child_argv, http, running

CONFIG = "hooks:\n  on_startup: [{shell: echo up}]\n"


def scrape(url: str) -> dict[str, promtext.Family]:
    status, headers, body = http("GET", f"{url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return promtext.parse(body.decode())


def test_the_wrapper_families_are_strictly_valid_and_counters_only_grow(tmp_path: Path) -> None:
    with running(tmp_path, child_argv(), CONFIG, timeout=30) as wrapper:
        first = scrape(wrapper.url)
        assert promtext.value(first, "llama_wrapper_state", state="ready") == 1
        assert promtext.value(first, "llama_wrapper_state", state="starting") == 0
        assert promtext.value(first, "llama_wrapper_starts_total", outcome="ready") == 1
        assert promtext.value(first, "llama_wrapper_hook_runs_total", hook="on_startup", outcome="ok") == 1
        router = {"vllm:num_requests_waiting", "vllm:num_requests_running"}  # no KV gauge without the slot built-ins
        assert router <= set(first) and all(name.startswith("llama_wrapper_") for name in set(first) - router)
        off = ("llama_wrapper_store_", "llama_wrapper_degrade_", "llama_wrapper_pool_", "llama_wrapper_spec_",
               "llama_wrapper_asleep", "llama_wrapper_conversation_cache_", "llama_wrapper_slot_",
               "llama_wrapper_projector_")
        assert not [name for name in first if name.startswith(off)]  # features this config leaves off
        for _ in range(3):
            assert http("GET", f"{wrapper.url}/echo")[0] == 200
        assert http("GET", f"{wrapper.url}/wrapper/status")[0] == 200  # not proxied: not counted
        second = scrape(wrapper.url)
        assert promtext.value(second, "llama_wrapper_requests_total", status_class="2xx") == \
            promtext.value(first, "llama_wrapper_requests_total", status_class="2xx") + 3
        before, after = promtext.counters(first), promtext.counters(second)
        assert all(after.get(key, 0) >= count for key, count in before.items())


@pytest.mark.parametrize("text", [
    "# TYPE a counter\na_total 1\n# TYPE b gauge\nb 1\na_total 2\n",  # a family split in two
    "# TYPE a counter\n# TYPE a counter\na_total 1\n",  # TYPE twice
    'a{x="1" 2\n',  # unclosed labels
    "a one\n",  # not a number
    "a 1\na 2\n",  # the same sample twice
])
def test_the_strict_reader_refuses_what_a_strict_scraper_refuses(text: str) -> None:
    with pytest.raises(promtext.Malformed):
        promtext.parse(text)
