"""Which class a request is (its header, its body's service_tier, the agents' own headers, its API key), and the
`priority:` section."""

from __future__ import annotations

from pathlib import Path

import pytest
from multidict import CIMultiDict

from tests.helpers import ROOT
from wrapper import built_ins
from wrapper.asked import Class
from wrapper.configuration import argv as args
from wrapper.configuration.config import ConfigError
from wrapper.configuration.sections import PRIORITY, PrioritySettings
from wrapper.queue import priority
from wrapper.queue.priority import AGENT_MARKS, SESSION_HEADERS, classed, classify, odd_marks, unsaid

KEYS = PrioritySettings(background_keys=("agent-key", "batch-key"))


@pytest.mark.parametrize(("headers", "payload", "expected"), [
    ({}, {}, Class.INTERACTIVE),
    ({}, None, Class.INTERACTIVE),
    ({"X-Priority": "background"}, {}, Class.BACKGROUND),
    ({"X-Priority": " Background "}, {}, Class.BACKGROUND),
    ({"X-Priority": "interactive"}, {"service_tier": "flex"}, Class.INTERACTIVE),  # the header says it first
    ({"X-Priority": "urgent"}, {"service_tier": "flex"}, Class.BACKGROUND),  # a word it does not know: not said
    ({}, {"service_tier": "flex"}, Class.BACKGROUND),
    ({}, {"service_tier": " FLEX "}, Class.BACKGROUND),
    ({}, {"service_tier": "priority"}, Class.INTERACTIVE),
    ({}, {"service_tier": "auto"}, Class.INTERACTIVE),
    ({}, {"service_tier": ["flex"]}, Class.INTERACTIVE),
    ({"Authorization": "Bearer agent-key"}, {}, Class.BACKGROUND),
    ({"Authorization": "bearer batch-key"}, {}, Class.BACKGROUND),
    ({"X-Api-Key": "agent-key"}, {}, Class.BACKGROUND),
    ({"Authorization": "Bearer agent-key2"}, {}, Class.INTERACTIVE),
    ({"Authorization": "Bearer agent-key"}, {"service_tier": "priority"}, Class.INTERACTIVE),
    ({"Authorization": "Basic agent-key"}, {}, Class.INTERACTIVE),
])
def test_a_request_says_its_class_by_header_tier_or_key(headers: dict[str, str], payload: dict[str, object] | None,
                                                        expected: Class) -> None:
    assert classify(headers, payload, KEYS) is expected


def test_what_the_wrapper_does_not_know_is_told() -> None:
    assert odd_marks({"X-Priority": "low"}, {"service_tier": "FLEX"}) == ["X-Priority: low"]
    assert odd_marks({}, {"service_tier": ["flex"]}) == ['service_tier: ["flex"]']
    assert odd_marks({"X-Priority": "Interactive"}, {"service_tier": "auto"}) == []
    assert odd_marks({}, None) == []


def test_without_background_keys_a_key_is_interactive() -> None:
    assert classify({"Authorization": "Bearer agent-key"}, {}, PrioritySettings()) is Class.INTERACTIVE


def test_service_tier_is_not_sent_on() -> None:
    payload = {"messages": [], "service_tier": "flex"}
    assert unsaid(payload) and payload == {"messages": []}
    assert not unsaid(payload)
    nothing: dict[str, object] = {"service_tier": None}
    assert unsaid(nothing) and nothing == {}


@pytest.mark.parametrize(("written", "expected"), [
    ("", None), ("preempt: auto", None), ("preempt: true", True), ("preempt: on", True), ("preempt: false", False),
])
def test_preempt_is_true_false_or_auto(written: str, expected: bool | None) -> None:
    config = built_ins.parse(f"priority: {{{written}}}\n" if written else "")
    assert PRIORITY.of(config).preempt is expected


@pytest.mark.parametrize(("written", "says"), [
    ("preempt: maybe", "priority.preempt must be true, false or auto, not 'maybe'"),
    ("background_keys: agent-key", "priority.background_keys must be a list of API keys"),
    ("background_keys: [1234]", "priority.background_keys[0] must be a non-empty string (its value is not shown)"),
    ("background_keys: ['']", "priority.background_keys[0] must be a non-empty string"),
    ("max_pauses: -1", "priority.max_pauses must be 0 or more"),
])
def test_bad_settings_say_what_to_write(written: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        built_ins.parse(f"priority: {{{written}}}\n")
    assert says in str(caught.value)
    assert "1234" not in str(caught.value)


def test_keys_are_never_shown() -> None:
    config = built_ins.parse("priority: {background_keys: [\"s3cret-one\", \"s3cret-two\"]}\n")
    assert PRIORITY.of(config).background_keys == ("s3cret-one", "s3cret-two")
    assert PRIORITY.shown(config)["background_keys"] == "(2 set)"


SLOTS = "slots: {dir: /tmp/slots}\nhooks:\n  on_startup: [{builtin: slots.restore}]\n"


@pytest.mark.parametrize(("written", "on", "why"), [
    (SLOTS, True, "yields its slot"),
    (SLOTS + "priority: {preempt: false}\n", False, "priority.preempt is false"),
    (SLOTS + "priority: {max_pauses: 0}\n", False, "priority.max_pauses is 0: nothing is paused"),
    (SLOTS + "cache: {enabled: false}\n", False, "cache.enabled is false"),
    ("", False, "name them in your hooks (on_startup: [{builtin: slots.restore}]"),
    ("priority: {preempt: true}\n", False, "comes with the slot built-ins"),
])
def test_preemption_needs_the_conversation_cache(written: str, on: bool, why: str) -> None:
    config = built_ins.parse(written)
    enabled, said = built_ins.preemption(config)
    assert enabled is on and why in said


def test_check_warns_when_preemption_is_asked_for_and_cannot_be() -> None:
    assert any("priority.preempt is true" in w for w in built_ins.warnings(built_ins.parse(
        "priority: {preempt: true}\n")))
    assert not any("priority" in w for w in built_ins.warnings(built_ins.parse("")))


CLAUDE, CODEX, OPENCODE = "x-claude-code-request-class", "x-openai-subagent", "x-parent-session-id"


@pytest.mark.parametrize(("headers", "expected"), [
    ({CLAUDE: "subagent"}, Class.BACKGROUND),
    ({CLAUDE: "workflow"}, Class.BACKGROUND),
    ({CLAUDE: "compaction"}, Class.BACKGROUND),
    ({CLAUDE: "auxiliary"}, Class.BACKGROUND),
    ({"X-Claude-Code-Request-Class": " SubAgent "}, Class.BACKGROUND),  # names and values in any case
    ({CLAUDE: "main"}, Class.INTERACTIVE),  # its own loop: says nothing, and nothing else says
    ({CLAUDE: "main", "Authorization": "Bearer agent-key"}, Class.BACKGROUND),  # ... so its key decides
    ({CLAUDE: "weird"}, Class.INTERACTIVE),  # a value it does not know says nothing
    ({CLAUDE: ""}, Class.INTERACTIVE),
    ({CODEX: "review"}, Class.BACKGROUND),
    ({CODEX: "compact"}, Class.BACKGROUND),
    ({CODEX: "memory_consolidation"}, Class.BACKGROUND),
    ({CODEX: "collab_spawn"}, Class.BACKGROUND),
    ({"X-OpenAI-Subagent": "a-new-one"}, Class.BACKGROUND),  # any value
    ({CODEX: " "}, Class.INTERACTIVE),  # not an empty one
    ({OPENCODE: "ses_parent"}, Class.BACKGROUND),  # a subagent's request
    ({"x-session-affinity": "ses_1"}, Class.INTERACTIVE),  # opencode's own session: says nothing
    ({"x-litellm-session-id": "s", "x-claude-code-session-id": "s"}, Class.INTERACTIVE),
])
def test_the_agents_own_headers(headers: dict[str, str], expected: Class) -> None:
    assert classify(CIMultiDict(headers), {}, KEYS) is expected  # aiohttp's headers, any case
    assert odd_marks(CIMultiDict(headers), {}) == []  # never logged: agents add values over time


@pytest.mark.parametrize(("headers", "payload", "expected"), [
    ({"X-Priority": "interactive", CLAUDE: "subagent"}, {}, Class.INTERACTIVE),  # X-Priority first
    ({"X-Priority": "background", CLAUDE: "main"}, {}, Class.BACKGROUND),
    ({CODEX: "review"}, {"service_tier": "priority"}, Class.INTERACTIVE),  # then service_tier
    ({"X-Priority": "urgent", CODEX: "review"}, {"service_tier": "auto"}, Class.BACKGROUND),  # neither says
    ({OPENCODE: "ses_parent", "Authorization": "Bearer someone-else"}, {}, Class.BACKGROUND),  # before the key
])
def test_explicit_marks_come_before_the_agents(headers: dict[str, str], payload: dict[str, object],
                                              expected: Class) -> None:
    assert classify(CIMultiDict(headers), payload, KEYS) is expected


def _with_headers(written: str) -> PrioritySettings:
    settings = PRIORITY.of(built_ins.parse(f"priority:\n  background_keys: [agent-key]\n  headers:\n{written}"))
    assert settings.background_keys == ("agent-key",)
    return settings


def test_priority_headers_add_marks_and_replace_the_built_in_ones() -> None:
    settings = _with_headers("    X-Claude-Code-Request-Class: {Main: interactive, subagent: background}\n"
                             "    x-my-batch-job: {\"*\": background, urgent: interactive}\n"
                             "    x-openai-subagent: {review: interactive}\n"
                             "    x-tier: {on: background, 1: background}\n")

    def said(headers: dict[str, str]) -> Class:
        return classify(CIMultiDict(headers), {}, settings)
    assert said({CLAUDE: "main", "Authorization": "Bearer agent-key"}) is Class.INTERACTIVE  # before the key now
    assert said({CLAUDE: "subagent"}) is Class.BACKGROUND
    assert said({CLAUDE: "compaction"}) is Class.INTERACTIVE  # the built-in entry is replaced whole
    assert said({"x-my-batch-job": "nightly"}) is Class.BACKGROUND  # "*": any value
    assert said({"x-my-batch-job": " Urgent"}) is Class.INTERACTIVE  # a value named wins over "*"
    assert said({"x-my-batch-job": ""}) is Class.INTERACTIVE
    assert said({CODEX: "review"}) is Class.INTERACTIVE and said({CODEX: "compact"}) is Class.INTERACTIVE
    assert said({OPENCODE: "ses_parent"}) is Class.BACKGROUND  # a built-in not named stays
    assert said({"x-tier": "on"}) is Class.BACKGROUND and said({"x-tier": "1"}) is Class.BACKGROUND  # as written
    assert said({"X-Priority": "interactive", "x-my-batch-job": "x"}) is Class.INTERACTIVE
    shown = PRIORITY.shown(built_ins.parse("priority: {headers: {x-my-batch-job: {'*': background}}}\n"))
    assert shown["headers"] == {"x-my-batch-job": {"*": "background"}}
    assert PRIORITY.shown(built_ins.parse(""))["headers"] == "none" and PrioritySettings().headers == ()


@pytest.mark.parametrize(("written", "says"), [
    ("    x-job: {'*': low}\n", "priority.headers.x-job.* must be background or interactive, not 'low'"),
    ("    x-job: {main: true}\n", "priority.headers.x-job.main must be background or interactive, not True"),
    ("    x-job: background\n", "priority.headers.x-job must be a mapping of value -> background | interactive"),
    ("    - x-job\n", "priority.headers must be a mapping of header -> {value: background | interactive}"),
    ("    x-job: {'': background}\n", "priority.headers.x-job: each value must be a non-empty string"),
    ("    x-job: {a: background}\n    X-Job: {b: background}\n", "header 'x-job' given twice"),
])
def test_a_bad_header_mark_says_what_to_write(written: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _with_headers(written)
    assert says in str(caught.value)


def test_the_docs_table_names_every_agent_header() -> None:
    text = (Path(ROOT) / "docs" / "priority.md").read_text()
    table = text[text.index("The agents' own marks"):]
    table = table[:table.index("\n\n", table.index("| agent |"))]
    for name, values in AGENT_MARKS.items():
        assert f"`{name}`" in table and all(f"`{value}`" in table for value in values if value != "*")
    for name in SESSION_HEADERS:
        assert f"`{name}`" in table


@pytest.mark.parametrize(("lane", "argv", "slots_kvu", "on", "slots", "kvu"), [
    (None, ["-np", "1"], True, True, "2", True),  # the slot built-ins make one KV: a slot more is free
    (None, ["-np", "2", "-kvu"], False, True, "3", True),
    (None, [], False, True, None, False),  # automatic slots share one KV: one of them is kept, nothing added
    (None, ["-np", "2"], False, False, "2", False),  # a KV each: a slot more takes its share of -c
    (None, ["-np", "2", "-no-kvu"], True, False, "2", False),  # asked for a KV each
    ("no keys", ["-np", "1"], True, True, "2", True),  # auto, whatever marks the config uses
    (True, ["-np", "2"], False, True, "3", True),  # asked for: one KV too
    (True, ["-np", "2", "-no-kvu"], True, True, "3", False),  # asked for, and a KV each kept as given (its why says)
    (False, ["-np", "1"], True, False, "1", False),
])
def test_the_lane_a_server_keeps_for_interactive_requests(lane: bool | str | None, argv: list[str], slots_kvu: bool,
                                                          on: bool, slots: str | None, kvu: bool) -> None:
    keys = () if lane == "no keys" else ("agent-key",)
    settings = PrioritySettings(lane=None if isinstance(lane, str) else lane, background_keys=keys)
    full = ["llama-server", *argv]
    kept, why = priority.lane(settings, full, slots_kvu)
    assert kept is on and why
    assert on or lane is False or "priority.lane: true" in why  # off by auto: it says what to set
    assert ("-no-kvu" in why) is ("-no-kvu" in argv)  # what it says of the KV is what the argv has
    assert "-kvu added" not in why or priority.with_lane(full, kvu=True)[1][-1]["change"] == "-kvu"
    after = priority.with_lane(full, kvu=True)[0] if kept else full
    assert args.get(after, args.PARALLEL) == slots and args.has(after, args.KV_UNIFIED) is kvu


@pytest.mark.parametrize(("headers", "payload", "session"), [
    ({"X-Session-Id": "ses_1"}, None, "ses_1"),  # opencode
    ({"x-session-affinity": "ses_2"}, {"prompt_cache_key": "k"}, "ses_2"),  # the header first
    ({"session_id": "0199-abc"}, None, "0199-abc"),  # Codex's header
    ({"x-claude-code-session-id": "cc-1"}, None, "cc-1"),  # Claude Code's
    ({"x-litellm-session-id": "oh-1"}, {"prompt_cache_key": "k"}, "oh-1"),  # OpenHands'
    ({}, {"prompt_cache_key": "019a-thread"}, "019a-thread"),  # Codex's Responses body
    ({}, {"session_id": "s"}, "s"),
    ({"X-Session-Id": "  "}, {"prompt_cache_key": 7}, None),  # empty, or not a string: none
    ({"X-Session-Id": "a\nb" + "x" * 100}, None, "ab" + "x" * 62),  # printable, at most 64 characters
])
def test_the_session_an_agent_says(headers: dict[str, str], payload: dict[str, object] | None,
                                   session: str | None) -> None:
    assert priority.session_of(headers, payload) == session


def test_the_mark_that_classed_a_request_is_said() -> None:
    """What the log's `request.classed` says of each request: the class, and the mark that decided it."""
    settings = PrioritySettings(background_keys=("agent-key",))
    assert classed({"X-Priority": "Background"}, {}, settings) == (Class.BACKGROUND, "X-Priority: background")
    assert classed({}, {"service_tier": "flex"}, settings) == (Class.BACKGROUND, "service_tier: flex")
    codex = CIMultiDict({"X-OpenAI-Subagent": "review"})
    assert classed(codex, {}, settings) == (Class.BACKGROUND, "the agents' header x-openai-subagent")
    assert classed({"Authorization": "bearer agent-key"}, {}, settings) == (
        Class.BACKGROUND, "a background key (priority.background_keys)")
    assert classed({}, None, settings) == (Class.INTERACTIVE, "no mark: a person, as any request without one")


def test_who_asks_is_read_once_into_one_record() -> None:
    """`asked`: the record the queue, the passes and the steps read (wrapper/asked.py) — the consumer with its
    salt's digest, the class and the mark that decided it, the session; the log's words name the consumer, never the
    salt."""
    headers = {"Authorization": "bearer agent-key", "X-Session-Id": "s-1"}
    asked = priority.asked("/v1/chat/completions", "alice#3f9a", headers, {"messages": []}, KEYS)
    assert (asked.klass, asked.background, asked.session, asked.name, asked.salted) == (
        Class.BACKGROUND, True, "s-1", "alice", True)
    assert asked.said() == {"path": "/v1/chat/completions", "consumer": "alice", "salted": True,
                            "class": "background", "by": "a background key (priority.background_keys)",
                            "session": "s-1"}
    person = priority.asked("/v1/messages", None, {}, None, KEYS)
    assert (person.klass, person.name, person.salted, person.session) == (Class.INTERACTIVE, None, False, None)
