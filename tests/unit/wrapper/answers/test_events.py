"""Passing an event stream through with its last events held back, and a continuation's echo cut off."""

from __future__ import annotations

import json
from typing import Any

from wrapper.answers.apis.chat import Chat
from wrapper.answers.apis.completion import Completion
from wrapper.answers.events import Events
from wrapper.answers.part import Had, Part


def event(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


def chunk(content: str | None = None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": None} if role else {}
    if content is not None:
        delta["content"] = content
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}]}


def test_the_stop_event_and_done_are_held_back_whatever_the_chunking() -> None:
    stream = b"".join([event(chunk(role=True)), event(chunk("Hel")), event(chunk("lo")),
                       event({**chunk(finish="length"), "timings": {"cache_n": 10, "prompt_n": 5, "predicted_n": 2}}),
                       event(b"[DONE]")])
    events = Events(Chat())
    passed = b"".join(events.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))  # split anywhere
    assert passed == stream[:len(passed)] and b"length" not in passed and b"[DONE]" not in passed
    assert events.part.content == ["Hel", "lo"] and events.final is not None
    assert events.release().endswith(event(b"[DONE]"))
    assert Chat().as_answer(events.final)["usage"] == {"total_tokens": 17, "completion_tokens": 2}


def test_a_continuation_drops_its_role_chunk_and_the_echoed_prefix() -> None:
    events = Events(Chat(), Part(Had(text="Hello wor"), continuing=True))
    out = events.feed(event(chunk(role=True)) + event(chunk("Hello")) + event(chunk(" world")) + event(chunk("!")))
    sent = [json.loads(line[5:]) for line in out.decode().splitlines() if line.startswith("data:")]
    assert [c["choices"][0]["delta"]["content"] for c in sent] == ["ld", "!"]
    assert events.part.content == ["ld", "!"]


def test_a_prefix_that_is_not_echoed_is_not_cut() -> None:
    events = Events(Chat(), Part(Had(text="Hello"), continuing=True))
    events.feed(event(chunk("Bye")) + event(chunk(" now")))
    assert events.part.content == ["Bye", " now"]


def test_completion_events() -> None:
    events = Events(Completion())
    passed = events.feed(event({"content": "a", "stop": False}) + event({"content": "", "stop": True,
                                                                         "truncated": True}))
    assert b'"a"' in passed and events.final == {"content": "", "stop": True, "truncated": True}
    assert events.part.content == ["a"]
