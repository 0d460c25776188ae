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


def test_timings_the_wrapper_asked_for_are_read_and_not_passed_on_but_the_ends() -> None:
    """A request offering tools is asked for per-token timings (so that a call cut under way goes on from a prefill
    of the count generated): its client, which did not ask, gets each event without them but for the end's, which
    llama-server sends whether asked or not; the part reads the count, first pass (bytes passed on as they came)
    and continuation (events rewritten) alike."""
    def timed(payload: dict[str, Any], n: int) -> dict[str, Any]:
        return {**payload, "id": "c1", "timings": {"predicted_n": n, "predicted_ms": 1.5}}

    llama = [timed(chunk(role=True), 1), timed(chunk("Hel"), 2), timed(chunk("lo"), 3)]
    end = [{**timed(chunk(finish="length"), 3)}, {"choices": [], "usage": {"completion_tokens": 3}, "timings": {}}]
    wire = b"".join(event(json.dumps(p, separators=(",", ":")).encode()) for p in [*llama, *end])
    for part in (Part(), Part(Had(text="He"), continuing=True)):
        events = Events(Chat(), part, holds=False, untimed=True)
        passed = b"".join(events.feed(wire[i:i + 11]) for i in range(0, len(wire), 11))
        sent = [json.loads(line[5:]) for line in passed.decode().splitlines() if line.startswith("data:")]
        assert [("timings" in p) for p in sent] == [False] * (len(sent) - 2) + [True, True], sent
        assert events.part.decoded == 3
    asked = Events(Chat(), holds=False)  # the client asked for them: passed on as they came
    assert asked.feed(wire) == wire and asked.part.decoded == 3
