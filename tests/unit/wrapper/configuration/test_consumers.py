"""The consumers' section: a name per key, shares, isolation, the public beginning; a request's consumer."""

from __future__ import annotations

import pytest

from wrapper import built_ins
from wrapper.configuration.config import ConfigError
from wrapper.configuration.consumers import (
    ANONYMOUS,
    CONSUMERS,
    NotAUser,
    Share,
    consumer_of,
    is_salted,
    isolating,
    known,
    name_of,
    salted,
    share_for,
    share_of,
)

TWO = 'consumers:\n  keys: {alice: ["sk-a"], bob: ["sk-b", "sk-b2"]}\n'


def test_a_request_is_the_consumer_its_key_names_else_anonymous() -> None:
    settings = CONSUMERS.of(built_ins.parse(TWO))
    assert consumer_of({"Authorization": "Bearer sk-a"}, settings) == "alice"
    assert consumer_of({"Authorization": "bearer sk-b2"}, settings) == "bob"
    assert consumer_of({"X-Api-Key": "sk-b"}, settings) == "bob"
    assert consumer_of({"Authorization": "Bearer nope"}, settings) == ANONYMOUS
    assert consumer_of({}, settings) == ANONYMOUS
    assert consumer_of({"Authorization": "Bearer sk-a"}, CONSUMERS.of(built_ins.parse(""))) is None  # off


@pytest.mark.parametrize(("written", "isolated"), [
    (TWO, True), (TWO + "  isolate: false\n", False),
    ('consumers: {keys: {alice: ["sk-a"]}}\n', False), ('consumers: {keys: {alice: ["sk-a"]}, isolate: true}\n', True),
])
def test_isolation_is_on_when_more_than_one_consumer_is_named(written: str, isolated: bool) -> None:
    assert isolating(CONSUMERS.of(built_ins.parse(written))) is isolated


def test_shares_and_the_public_beginning_are_read() -> None:
    config = built_ins.parse(TWO + "  shares: {bob: {folder: 2GiB, bucket: 10GiB, slots: 1}, "
                             "anonymous: {folder: 1MiB}}\n"
                             "  shared_prefix: {messages: [{role: system, content: Be brief.}]}\n")
    settings = CONSUMERS.of(config)
    assert share_of(settings, "bob") == Share(folder=2 << 30, bucket=10 << 30, slots=1)
    assert share_of(settings, ANONYMOUS) == Share(folder=1 << 20)
    assert share_of(settings, "alice") == Share()
    shown = CONSUMERS.shown(config)
    assert shown["keys"] == {"alice": "(1 set)", "bob": "(2 set)"} and "sk-" not in str(shown)
    assert shown["shared_prefix"] == "1 messages, 0 tools"


@pytest.mark.parametrize(("written", "says"), [
    ('keys: {alice: ""}', "consumers.keys.alice: each key must be a non-empty string"),
    ('keys: {alice: [1234]}', "each key must be a non-empty string (its value is not shown)"),
    ('keys: {alice: ["k"], bob: ["k"]}', "consumers.keys.bob: this key is alice's too: one key, one consumer"),
    ('keys: {bob: ["k", "k"]}', "consumers.keys.bob: this key is given twice (its value is not shown)"),
    ('keys: {anonymous: ["k"]}', "'anonymous' is the consumer of requests no key names"),
    ('keys: {"a b": ["k"]}', "a consumer's name is 1 to 64 letters"),
    ('keys: [alice]', "consumers.keys must be a mapping of consumer name -> its API keys"),
    ('keys: {alice: ["k"]}, shares: {carol: {folder: 1GiB}}', "consumers.shares.carol: no consumer of that name"),
    ('shares: {alice: {disk: 1GiB}}', "unknown key 'disk' in consumers.shares.alice"),
    ('shares: {alice: {slots: 0}}', "consumers.shares.alice.slots must be 1 or more"),
    ("shared_prefix: {messages: [{role: sys, text: x}]}", "shared_prefix.messages[0] must have a `role` and a"),
    ('shared_prefix: {prompt: x, messages: []}', "either `prompt` or `messages`"),
    ('shared_prefix: {tools: []}', "`tools` come with `messages`"),
    ('shared_prefix: {messages: hello}', "consumers.shared_prefix.messages must be a list of mappings"),
])
def test_bad_settings_say_what_to_write(written: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        built_ins.parse(f"consumers: {{{written}}}\n")
    assert says in str(caught.value)
    assert "1234" not in str(caught.value)


# -- users behind a front-end's key, a request's cache_salt ------------------------------------------------------

FRONT_END = ('consumers:\n  keys: {open-webui: ["sk-owui"], alice: ["sk-a"]}\n'
             '  by_header: {open-webui: X-OpenWebUI-User-Id}\n  shares: {open-webui: {slots: 1}}\n')


def test_a_front_ends_user_is_its_own_consumer_only_with_the_front_ends_key() -> None:
    """Open WebUI holds one key for everyone and names each user in a header: a request with that key and the
    header is the consumer `open-webui/<user>`; the header counts only with that key (anyone may send it)."""
    settings = CONSUMERS.of(built_ins.parse(FRONT_END))
    user = {"Authorization": "Bearer sk-owui", "X-OpenWebUI-User-Id": "42"}
    assert consumer_of(user, settings) == "open-webui/42"
    assert consumer_of({"Authorization": "Bearer sk-owui"}, settings) == "open-webui"  # no header: the front-end
    assert consumer_of({"Authorization": "Bearer sk-a", "X-OpenWebUI-User-Id": "42"}, settings) == "alice"
    assert consumer_of({"X-OpenWebUI-User-Id": "42"}, settings) == ANONYMOUS  # claiming a user without the key
    assert consumer_of({**user, "X-OpenWebUI-User-Id": "bob@example.com"}, settings) == "open-webui/bob@example.com"
    for odd in ("../../etc", "a b", "x" * 129, "ünïcode", "-lead"):
        with pytest.raises(NotAUser, match="X-OpenWebUI-User-Id"):
            consumer_of({**user, "X-OpenWebUI-User-Id": odd}, settings)
    assert known(settings, "open-webui/42") and known(settings, "alice") and not known(settings, "alice/42")
    assert not known(settings, "open-webui/a b") and not known(settings, "nobody")


def test_by_header_names_a_consumer_with_keys_and_a_header() -> None:
    with pytest.raises(ConfigError, match="the name of an HTTP header"):
        built_ins.parse('consumers:\n  keys: {owui: ["k"]}\n  by_header: {owui: "not a header"}\n')
    with pytest.raises(ConfigError, match=r"consumers\.by_header\.owui: no consumer of that name in consumers\.keys"):
        built_ins.parse('consumers:\n  keys: {a: ["k"]}\n  by_header: {owui: X-User}\n')


def test_a_salt_makes_an_owner_of_its_own_counted_as_its_consumer() -> None:
    """`cache_salt`: the owner is the consumer's, private to a digest of the salt (never the salt itself); the
    status, /metrics and the shares count it as its consumer; a front-end's share bounds each of its users."""
    owner = salted("alice", "s3cret")
    assert owner.startswith("alice#") and "s3cret" not in owner and owner == salted("alice", "s3cret")
    assert salted("alice", "other") != owner and salted(None, "s3cret").startswith(f"{ANONYMOUS}#")
    assert is_salted(owner) and not is_salted("alice") and not is_salted(None)
    assert name_of(owner) == "alice" and name_of("open-webui/42") == "open-webui/42"
    shares = {"open-webui": 1, "alice": 3}
    assert share_for(shares, "open-webui/42") == 1 and share_for(shares, salted("open-webui/42", "x")) == 1
    assert share_for(shares, owner) == 3 and share_for(shares, "bob") is None and share_for(shares, None) is None
