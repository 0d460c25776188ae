"""What a chat answer under way gives its client besides its text — its reasoning, its tool calls — and how it goes
on after a loss of the server: the request that goes on, and what the next part shows (nothing twice, the tool
call's id and name once, its arguments whole), without a server."""

from __future__ import annotations

import json
from typing import Any

from wrapper.answers import apis
from wrapper.answers.apis.chat import Chat
from wrapper.answers.continuation import SoFar
from wrapper.answers.events import Events
from wrapper.answers.part import Call, Had, Part

CHAT = "/v1/chat/completions"
END = "\": \"x\"}"
ASKED: dict[str, Any] = {"messages": [{"role": "user", "content": "why?"}], "max_tokens": 100, "temperature": 0}


def sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)


def delta(id: str = "chatcmpl-1", **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": fields}], "id": id,
            "object": "chat.completion.chunk"}


def after(had: Had) -> Events:
    return Events(Chat(), Part(had, continuing=True))


def shown(events: Events, raw: bytes) -> list[dict[str, Any]]:
    out = events.feed(raw)
    return [json.loads(line[6:])["choices"][0]["delta"] for line in out.decode().split("\n\n") if line]


def test_an_answer_within_its_reasoning_goes_on_within_it() -> None:
    first = Events(Chat())
    first.feed(sse(delta(role="assistant", content=None), delta(reasoning_content="\nThe"),
                   delta(reasoning_content=" sky"), delta(reasoning_content=" is"), delta(reasoning_content=" blue")))
    so_far = SoFar(Chat())
    so_far.took(first.part)
    body, had = so_far.going_on(ASKED, True)
    assert body["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": "\nThe sky is"}
    assert body["max_tokens"] == 97 and (had.text, had.again) == ("", 0) and (had.reasoning, had.again_reasoning) == (
        "\nThe sky is", 1)  # " blue" is made again, and not shown twice
    next_part = after(had)
    passed = shown(next_part, sse(delta("chatcmpl-2", role="assistant", content=None),
                              delta("chatcmpl-2", reasoning_content="\nThe sky is"),  # the prefill, echoed
                              delta("chatcmpl-2", reasoning_content=" blue"),
                              delta("chatcmpl-2", reasoning_content=" because"),
                              delta("chatcmpl-2", content="Light")))
    assert passed == [{"reasoning_content": " because"}, {"content": "Light"}]
    so_far.took(next_part.part)
    assert "".join(so_far.reasoning) == "\nThe sky is blue because" and so_far.text == "Light"


def test_a_tool_call_under_way_is_made_again_from_the_start_and_shown_only_what_its_client_lacks() -> None:
    """A call cut in the middle: the request goes again as it came (a model given only the text before the call as
    a prefix may not make it again: Llama 3.1's answered text), and the client is shown only the rest of the call,
    under the id and name it has."""
    first = Events(Chat())
    first.feed(sse(delta(role="assistant", content=None), delta(content="Reading"), delta(content=" it."),
                   delta(tool_calls=[{"index": 0, "id": "call-A", "type": "function",
                                      "function": {"name": "read_file", "arguments": "{"}}]),
                   delta(tool_calls=[{"index": 0, "function": {"arguments": "\"pa"}}])))
    so_far = SoFar(Chat())
    so_far.took(first.part)
    assert so_far.calls == {0: Call("call-A", "read_file", "{\"pa")} and so_far.tokens == 4
    asked = {**ASKED, "tools": [{"type": "function"}]}
    body, had = so_far.going_on(asked, True)
    assert body == asked  # the request as it came
    assert (had.text, had.again, had.again_calls) == ("", 2, 2) and had.calls == [Call("call-A", "read_file", "{\"pa")]
    next_part = after(had)
    opened = {"index": 0, "id": "call-B", "type": "function", "function": {"name": "read_file", "arguments": "{"}}
    passed = shown(next_part, sse(delta("chatcmpl-2", role="assistant", content=None),
                                  delta("chatcmpl-2", content="Reading"), delta("chatcmpl-2", content=" it."),
                                  delta("chatcmpl-2", tool_calls=[opened]),
                                  delta("chatcmpl-2", tool_calls=[{"index": 0, "function": {"arguments": "\"path"}}]),
                                  delta("chatcmpl-2", tool_calls=[{"index": 0, "function": {"arguments": END}}])))
    assert passed == [{"tool_calls": [{"index": 0, "function": {"arguments": "th"}}]},
                      {"tool_calls": [{"index": 0, "function": {"arguments": "\": \"x\"}"}}]}]  # no new id, no name
    so_far.took(next_part.part)
    assert so_far.calls == {0: Call("call-A", "read_file", "{\"path\": \"x\"}")} and so_far.text == "Reading it."
    json.loads(so_far.calls[0].arguments)  # whole, valid JSON


def test_a_second_call_the_client_had_not_seen_comes_whole() -> None:
    next_part = after(Had(calls=[Call("call-A", "f", "{}")]))
    again = {"index": 0, "id": "x", "function": {"name": "f", "arguments": "{}"}}
    passed = shown(next_part, sse(delta(tool_calls=[again]),
                                  delta(tool_calls=[{"index": 1, "id": "call-2", "type": "function",
                                                     "function": {"name": "g", "arguments": "{}"}}])))
    assert passed == [{"tool_calls": [{"index": 1, "id": "call-2", "type": "function",
                                       "function": {"name": "g", "arguments": "{}"}}]}]


def test_what_goes_on_after_a_loss_and_what_is_paused() -> None:
    chat = apis.of(CHAT)
    assert chat.cannot_go_on({**ASKED, "tools": [{}]}) is None  # made again after a loss: whole
    assert chat.cannot_pause({**ASKED, "tools": [{}]}) == "tools"  # but not exactly: not paused
    assert apis.of("/v1/responses").cannot_go_on(ASKED) is None and apis.of("/v1/messages").cannot_go_on(ASKED) is None
    assert apis.of("/v1/responses").cannot_pause(ASKED) == apis.of("/v1/messages").cannot_pause(ASKED) == "api"
    for path in ("/completion", "/completions", "/v1/completions", "/infill"):  # every generating endpoint goes on
        assert apis.of(path).cannot_go_on({"prompt": "x", "input_prefix": "", "input_suffix": ""}) is None, path
    assert apis.of("/infill").cannot_pause({"input_prefix": "", "input_suffix": ""}) == "api"  # made again instead
    assert apis.of("/v1/embeddings").cannot_go_on({"input": "x"}) == "api"
    assert chat.cannot_go_on({**ASKED, "n": 2}) == "choices"
    assert apis.of("/v1/completions").cannot_go_on({"prompt": ["a", "b"]}) == "choices"  # two prompts
    assert apis.of("/completion").cannot_go_on({"prompt": [1, 2, "x"]}) is None  # one mixed prompt
    assert apis.of("/completion").cannot_pause({"prompt": "x"}) is None


def test_an_answer_lost_before_a_word_began_is_made_again_from_the_start() -> None:
    """Its first token "\\n", read back as a prefix after the template's own newline, is "\\n\\n": the answer went
    on as "#\\n\\n##..." (a fresh pair of eyes, every time). With no word begun, the request goes again as it came
    and the events the client has are not shown twice."""
    first = Events(Chat())
    first.feed(sse(delta(role="assistant", content=None), delta(content="\n")))
    so_far = SoFar(Chat())
    so_far.took(first.part)
    body, had = so_far.going_on(ASKED, True)
    assert body == ASKED and body is not ASKED and (had.text, had.again, had.reasoning) == ("", 1, "")
    thinking = Events(Chat())
    thinking.feed(sse(delta(role="assistant", content=None), delta(reasoning_content="Okay")))
    so_far = SoFar(Chat())
    so_far.took(thinking.part)
    body, had = so_far.going_on(ASKED, True)
    assert body == ASKED and (had.text, had.again, had.reasoning, had.again_reasoning) == ("", 0, "", 1)
    assert shown(after(had), sse(delta(reasoning_content="Okay"), delta(reasoning_content=", so"))) == [
        {"reasoning_content": ", so"}]


def test_what_llama_server_counted_is_carried_across_the_parts_of_a_call_that_goes_on() -> None:
    """The tokens generated for what the client has, as llama-server counted them (per-token timings): a call that
    goes on from a prefill of `n` tokens counts on from `n`; an answer that goes on from a text prefix the wrapper
    chose does not know its count (None), one generated again from the start counts from 0."""
    def timed(n: int, **fields: Any) -> dict[str, Any]:
        return {**delta(**fields), "timings": {"predicted_n": n}}

    opened = {"index": 0, "id": "call-A", "type": "function", "function": {"name": "write_file", "arguments": "{"}}
    first = Events(Chat(), holds=False)
    argument = {"index": 0, "function": {"arguments": "\"a"}}
    first.feed(sse(timed(1, role="assistant", content=None), timed(3, content="Sure."),
                   timed(9, tool_calls=[opened]), timed(11, tool_calls=[argument])))
    so_far = SoFar(Chat())
    assert so_far.generated is None  # nothing counted yet
    so_far.took(first.part)
    assert so_far.generated == so_far.generated_in_message == 11
    so_far.call_going_on(ASKED, "Sure.{...}{\"a", 11)
    second = Events(Chat(), Part(Had(text="Sure.", calls=[Call("call-A", "write_file", "{\"a")]), continuing=True))
    second.feed(sse(timed(1, tool_calls=[opened]), timed(2, tool_calls=[{"index": 0, "function": {"arguments": "b"}}])))
    so_far.took(second.part)
    assert so_far.generated == 13  # 11 in the prefill, 2 since
    so_far.going_on(ASKED, True)  # a call under way generated again from the start: its new part counts from 0
    assert so_far.counted_from == 0
    text = SoFar(Chat())
    text.took(Events(Chat(), holds=False).part)
    text.pieces = ["Once", " upon", " a"]
    text.going_on(ASKED, True)  # from a text prefix: its tokens as decoding made them are not known
    assert text.counted_from is None
    assert SoFar(Chat()).generated_in_message is None
