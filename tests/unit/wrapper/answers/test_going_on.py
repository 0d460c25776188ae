"""What a chat answer under way gives its client besides its text — its reasoning, its tool calls — and how it goes
on after a loss of the server: the request that goes on, and what the next part shows (nothing twice, the tool
call's id and name once, its arguments whole), without a server."""

from __future__ import annotations

import json
from typing import Any

from wrapper.answers.continuation import SoFar, cannot_go_on, cannot_pause
from wrapper.answers.sse import Events, Had

CHAT = "/v1/chat/completions"
ASKED: dict[str, Any] = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": 100, "temperature": 0}


def sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)


def delta(id: str = "chatcmpl-1", **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": fields}], "id": id,
            "object": "chat.completion.chunk"}


def shown(events: Events, raw: bytes) -> list[dict[str, Any]]:
    out = events.feed(raw)
    return [json.loads(line[6:])["choices"][0]["delta"] for line in out.decode().split("\n\n") if line]


def test_an_answer_within_its_reasoning_goes_on_within_it() -> None:
    first = Events(chat=True)
    first.feed(sse(delta(role="assistant", content=None), delta(reasoning_content="\nThe"),
                   delta(reasoning_content=" sky"), delta(reasoning_content=" is"), delta(reasoning_content=" blue")))
    so_far = SoFar(chat=True)
    so_far.took(first)
    body, skip, again, had = so_far.going_on(CHAT, ASKED, True)
    assert body["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "\nThe sky is"}
    assert body["max_tokens"] == 97 and (skip, again) == ("", 0) and (had.reasoning, had.again_reasoning) == (
        "\nThe sky is", 1)  # " blue" is made again, and not shown twice
    after = Events(chat=True, continuing=True, had=had)
    passed = shown(after, sse(delta("chatcmpl-2", role="assistant", content=None),
                              delta("chatcmpl-2", reasoning_content="\nThe sky is"),  # the prefill, echoed
                              delta("chatcmpl-2", reasoning_content=" blue"),
                              delta("chatcmpl-2", reasoning_content=" because"),
                              delta("chatcmpl-2", content="Light")))
    assert passed == [{"reasoning_content": " because"}, {"content": "Light"}]
    so_far.took(after)
    assert "".join(so_far.reasoning) == "\nThe sky is blue because" and so_far.text == "Light"


def test_a_tool_call_under_way_is_made_again_and_shown_only_what_its_client_lacks() -> None:
    first = Events(chat=True)
    first.feed(sse(delta(role="assistant", content=None), delta(content="Reading"), delta(content=" it."),
                   delta(tool_calls=[{"index": 0, "id": "call-A", "type": "function",
                                      "function": {"name": "read_file", "arguments": "{"}}]),
                   delta(tool_calls=[{"index": 0, "function": {"arguments": "\"pa"}}])))
    so_far = SoFar(chat=True)
    so_far.took(first)
    assert so_far.calls == {0: ["call-A", "read_file", "{\"pa"]} and so_far.tokens == 4
    body, skip, again, had = so_far.going_on(CHAT, {**ASKED, "tools": [{"type": "function"}]}, True)
    assert body["messages"][-1] == {"role": "assistant", "content": "Reading it."}  # no tool_calls: refused there
    assert (skip, again) == ("Reading it.", 0) and had.calls == [("call-A", "read_file", "{\"pa")]
    after = Events(chat=True, continuing=True, skip=skip, had=had)
    passed = shown(after, sse(delta("chatcmpl-2", role="assistant", content=None),
                              delta("chatcmpl-2", content="Reading it."),
                              delta("chatcmpl-2", tool_calls=[{"index": 0, "id": "call-B", "type": "function",
                                                               "function": {"name": "read_file", "arguments": "{"}}]),
                              delta("chatcmpl-2", tool_calls=[{"index": 0, "function": {"arguments": "\"path"}}]),
                              delta("chatcmpl-2", tool_calls=[{"index": 0, "function": {"arguments": "\": \"x\"}"}}])))
    assert passed == [{"tool_calls": [{"index": 0, "function": {"arguments": "th"}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": "\": \"x\"}"}}]}]  # no new id, no name
    so_far.took(after)
    assert so_far.calls == {0: ["call-A", "read_file", "{\"path\": \"x\"}"]}
    json.loads(so_far.calls[0][2])  # whole, valid JSON


def test_a_second_call_the_client_had_not_seen_comes_whole() -> None:
    had = Had(calls=[("call-A", "f", "{}")])
    after = Events(chat=True, continuing=True, had=had)
    passed = shown(after, sse(delta(tool_calls=[{"index": 0, "id": "x", "function": {"name": "f", "arguments": "{}"}}]),
                              delta(tool_calls=[{"index": 1, "id": "call-2", "type": "function",
                                                 "function": {"name": "g", "arguments": "{}"}}])))
    assert passed == [{"tool_calls": [{"index": 1, "id": "call-2", "type": "function",
                                       "function": {"name": "g", "arguments": "{}"}}]}]


def test_what_goes_on_after_a_loss_and_what_is_paused() -> None:
    assert cannot_go_on(CHAT, {**ASKED, "tools": [{}]}) is None  # made again after a loss: whole
    assert cannot_pause(CHAT, {**ASKED, "tools": [{}]}) == "tools"  # but not exactly: not paused
    assert cannot_go_on("/v1/responses", ASKED) is None and cannot_go_on("/v1/messages", ASKED) is None  # goes on
    assert cannot_pause("/v1/responses", ASKED) == cannot_pause("/v1/messages", ASKED) == "api"  # not pinned
    assert cannot_go_on("/infill", ASKED) == "api"
    assert cannot_go_on(CHAT, {**ASKED, "n": 2}) == "choices"
    assert cannot_pause("/completion", {"prompt": "x"}) is None


def test_an_answer_lost_before_a_word_began_is_made_again_from_the_start() -> None:
    """Its first token "\\n", read back as a prefix after the template's own newline, is "\\n\\n": the answer went
    on as "#\\n\\n##..." (a fresh pair of eyes, every time). With no word begun, the request goes again as it came
    and the events the client has are not shown twice."""
    first = Events(chat=True)
    first.feed(sse(delta(role="assistant", content=None), delta(content="\n")))
    so_far = SoFar(chat=True)
    so_far.took(first)
    body, skip, again, had = so_far.going_on(CHAT, ASKED, True)
    assert body == ASKED and body is not ASKED and (skip, again, had.reasoning) == ("", 1, "")
    thinking = Events(chat=True)
    thinking.feed(sse(delta(role="assistant", content=None), delta(reasoning_content="Okay")))
    so_far = SoFar(chat=True)
    so_far.took(thinking)
    body, skip, again, had = so_far.going_on(CHAT, ASKED, True)
    assert body == ASKED and (skip, again, had.reasoning, had.again_reasoning) == ("", 0, "", 1)
    after = Events(chat=True, continuing=True, again=again, had=had)
    assert shown(after, sse(delta(reasoning_content="Okay"), delta(reasoning_content=", so"))) == [
        {"reasoning_content": ", so"}]
