"""A chat request continues a slot's conversation when its first messages are that slot's last request's."""

from __future__ import annotations

from typing import Any

from hooks.conversations.chain import messages_of


def chat(*contents: str, **fields: Any) -> dict[str, Any]:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)], **fields}


def test_the_next_turn_continues_and_a_regenerate_too() -> None:
    first = messages_of(chat("hello"))
    assert first is not None
    held = first.chain()
    nxt = messages_of(chat("hello", "hi there", "tell me more", max_tokens=5, temperature=0.3))
    again = messages_of(chat("hello", stream=True))  # the same question again, sampled otherwise
    assert nxt is not None and again is not None
    assert nxt.continues(held) and again.continues(held)


def test_an_edited_message_other_tools_or_a_shorter_request_do_not() -> None:
    held = messages_of(chat("hello", "hi there", "tell me more"))
    assert held is not None
    chain = held.chain()
    edited = messages_of(chat("hello!", "hi there", "tell me more", "and then?"))
    tools = messages_of(chat("hello", "hi there", "tell me more", "and then?", tools=[{"type": "function"}]))
    shorter = messages_of(chat("hello"))
    for request in (edited, tools, shorter):
        assert request is not None and not request.continues(chain)
    short = messages_of(chat("hello"))
    as_parts = messages_of({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]})
    assert short is not None and as_parts is not None and not as_parts.continues(short.chain())


def test_only_a_list_of_messages_has_a_chain() -> None:
    assert messages_of({"messages": []}) is None
    assert messages_of({"messages": "hello"}) is None
    assert messages_of({"prompt": "hello"}) is None
