"""The consumers' section: a name per key, shares, isolation, the public beginning; a request's consumer."""

from __future__ import annotations

import pytest

from wrapper import built_ins
from wrapper.configuration.config import ConfigError
from wrapper.configuration.consumers import ANONYMOUS, CONSUMERS, Share, consumer_of, isolating, share_of

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
