"""The gauges a router reads: the exposition under the configured names, strictly valid, and the `router:` keys."""

from __future__ import annotations

import pytest

from tests import promtext
from wrapper import built_ins
from wrapper.configuration.config import ConfigError
from wrapper.configuration.sections import ROUTER, RouterGaugeSettings
from wrapper.http.gauges import Load, exposition, loads


def test_the_defaults_are_the_names_the_endpoint_picker_reads() -> None:
    families = promtext.parse(exposition(RouterGaugeSettings(), Load(waiting=3, running=2, held=1024,
                                                                      context=4096)).decode())
    assert {name: family.kind for name, family in families.items()} == {
        "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge"}
    assert promtext.value(families, "vllm:num_requests_waiting") == 3
    assert promtext.value(families, "vllm:num_requests_running") == 2
    assert promtext.value(families, "vllm:kv_cache_usage_perc") == 0.25


@pytest.mark.parametrize(("held", "context", "shown"), [(None, 4096, None), (10, None, None), (10, 0, None),
                                                         (0, 4096, 0.0), (9000, 4096, 1.0)])
def test_a_kv_use_not_known_is_left_out_and_a_known_one_stays_within_0_and_1(
        held: int | None, context: int | None, shown: float | None) -> None:
    families = promtext.parse(exposition(RouterGaugeSettings(), Load(0, 0, held, context)).decode())
    if shown is None:
        assert "vllm:kv_cache_usage_perc" not in families
    else:
        assert promtext.value(families, "vllm:kv_cache_usage_perc") == shown


def test_names_come_from_the_config_and_an_empty_one_leaves_its_gauge_out() -> None:
    config = built_ins.parse("router: {waiting: 'wrapper:requests_waiting', running: '', kv_usage: kv_use}\n")
    names = ROUTER.of(config)
    assert names == RouterGaugeSettings(waiting="wrapper:requests_waiting", running="", kv_usage="kv_use")
    families = promtext.parse(exposition(names, Load(1, 1, 100, 1000)).decode())
    assert sorted(families) == ["kv_use", "wrapper:requests_waiting"]
    assert exposition(RouterGaugeSettings("", "", ""), Load(1, 1, 1, 1)) == b""


def test_a_name_prometheus_refuses_is_refused_at_load_with_what_to_write() -> None:
    with pytest.raises(ConfigError, match=r"router.waiting must be a Prometheus metric name .*'1-waiting'"):
        built_ins.parse("router: {waiting: 1-waiting}\n")


@pytest.mark.parametrize(("text", "said"), [
    ("router: {waiting: llama_wrapper_state}\n", r"router.waiting: 'llama_wrapper_state' is in a family /metrics"),
    ("router: {kv_usage: 'llamacpp:kv'}\n", r"router.kv_usage: 'llamacpp:kv' is in a family"),
    ("router: {running: q, kv_usage: q}\n", r"router.running and router.kv_usage are both 'q': give each gauge"),
    ("router: {waiting: vllm:num_requests_running}\n", r"router.waiting and router.running are both")])
def test_a_name_that_would_give_one_family_twice_is_refused(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        built_ins.parse(text)


def test_the_loads_say_the_same_in_sglangs_shape() -> None:
    """`GET /v1/loads`: one data-parallel rank with what the gauges say (a KV use not known is 0 there: the shape
    has no room for "not known"); the time as SGLang writes it, a text (SMG takes an answer whose `timestamp` is a
    number for no answer, and never asks that worker again)."""
    shown = loads(Load(waiting=3, running=2, held=1024, context=4096), now=1.5)
    assert shown == {"timestamp": "1970-01-01T00:00:01.500000+00:00", "dp_rank_count": 1, "loads": [
        {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 3, "num_total_reqs": 5, "num_used_tokens": 1024,
         "max_total_num_tokens": 4096, "token_usage": 0.25}]}
    unknown = loads(Load(waiting=0, running=0, held=None, context=None), now=2.0)["loads"][0]
    assert (unknown["num_used_tokens"], unknown["max_total_num_tokens"], unknown["token_usage"]) == (0, 0, 0.0)
