"""A Responses or Messages stream cut by a loss of the server goes on as one answer: the part after the loss is
shown under the client's ids (its response, items, calls; its block indexes), without what it echoes or makes
again, and closes with the whole answer's counts — llama-server's event shapes, written out, without a server."""

from __future__ import annotations

import json
from typing import Any

from wrapper.answers import apis
from wrapper.answers.apis.typed import Shown
from wrapper.answers.continuation import SoFar
from wrapper.answers.events import Events
from wrapper.answers.part import Call, Carry, Part

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def read(out: bytes) -> list[dict[str, Any]]:
    events = []
    for block in out.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            payload = json.loads(data[6:])
            assert payload["type"] == kind[7:]
            events.append(payload)
    return events


# -- Responses ---------------------------------------------------------------------------------------------------


def opened(resp: str) -> list[dict[str, Any]]:
    return [{"type": "response.created", "response": {"id": resp, "status": "in_progress"}},
            {"type": "response.in_progress", "response": {"id": resp, "status": "in_progress"}}]


def item(kind: str, id: str, **more: Any) -> dict[str, Any]:
    return {"type": "response.output_item.added", "item": {"type": kind, "id": id, **more}}


def text(msg: str, piece: str) -> dict[str, Any]:
    return {"type": "response.output_text.delta", "item_id": msg, "delta": piece}


def thought(rs: str, piece: str) -> dict[str, Any]:
    return {"type": "response.reasoning_text.delta", "item_id": rs, "delta": piece}


def arguments(fc: str, piece: str) -> dict[str, Any]:
    return {"type": "response.function_call_arguments.delta", "item_id": fc, "delta": piece}


def completed(resp: str, output: list[dict[str, Any]], generated: int, prompt: int) -> dict[str, Any]:
    return {"type": "response.completed", "response": {
        "id": resp, "status": "completed", "output": output,
        "usage": {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated}}}


def first_part(path: str, shown: Shown) -> Events:
    return Events(apis.of(path), frame=shown, holds=False)


def next_part(path: str, first: Events, shown: Shown, asked: dict[str, Any]) -> tuple[Events, dict[str, Any]]:
    """The part after a loss, as the answer makes it: what the client has, the request that goes on from it."""
    so_far = SoFar(apis.of(path))
    so_far.took(first.part)
    body, had = so_far.going_on(asked, False)
    carry = Carry(None, so_far.tokens, had.generated_again, None)
    return Events(apis.of(path), Part(had, continuing=True), holds=False, carry=carry, frame=shown), body


def test_a_responses_text_cut_goes_on_under_the_clients_ids_without_its_echo() -> None:
    shown = Shown()
    first = first_part(RESPONSES, shown)
    out = first.feed(sse(*opened("resp_A"), item("message", "msg_A", role="assistant", content=[]),
                         {"type": "response.content_part.added", "item_id": "msg_A", "part": {"type": "output_text"}},
                         text("msg_A", "The"), text("msg_A", " sky"), text("msg_A", " is")))
    assert len(read(out)) == 7 and first.part.content == ["The", " sky", " is"]  # read when asked: here, the loss
    assert shown.id == "resp_A" and shown.kinds == {"text": "msg_A"}
    asked = {"input": "why?", "max_output_tokens": 100, "stream": True}
    second, body = next_part(RESPONSES, first, shown, asked)
    assert body["input"] == [{"role": "user", "content": "why?"},
                             {"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": "The sky is"}]}]
    assert body["max_output_tokens"] == 97 and asked["input"] == "why?"  # the client's request stands
    whole = "The sky is blue."
    events = read(second.feed(sse(
        *opened("resp_B"), item("message", "msg_B", role="assistant", content=[]),
        {"type": "response.content_part.added", "item_id": "msg_B", "part": {"type": "output_text"}},
        text("msg_B", "The sky is"), text("msg_B", " blue"), text("msg_B", "."),
        {"type": "response.output_text.done", "item_id": "msg_B", "text": whole},
        {"type": "response.output_item.done", "item": {"type": "message", "id": "msg_B"}},
        completed("resp_B", [{"type": "message", "id": "msg_B"}], generated=3, prompt=40))))
    assert [e["type"] for e in events] == ["response.output_text.delta", "response.output_text.delta",
                                           "response.output_text.done", "response.output_item.done",
                                           "response.completed"]  # not opened again, the echo cut
    assert [e.get("delta") for e in events[:2]] == [" blue", "."]
    assert {e.get("item_id", e.get("item", {}).get("id")) for e in events[:4]} == {"msg_A"}
    done = events[-1]["response"]
    assert done["id"] == "resp_A" and done["output"][0]["id"] == "msg_A"
    assert done["usage"] == {"input_tokens": 37, "output_tokens": 6, "total_tokens": 43}  # 3 the client had
    assert second.part.content == [" blue", "."] and second.final is not None


def test_a_responses_answer_cut_in_its_reasoning_goes_on_within_it() -> None:
    shown = Shown()
    first = first_part(RESPONSES, shown)
    first.feed(sse(*opened("resp_A"), item("reasoning", "rs_A", summary=[]), thought("rs_A", "Light"),
                   thought("rs_A", " scatters")))
    asked = {"input": [{"type": "message", "role": "user", "content": "why?"}], "stream": True}
    second, body = next_part(RESPONSES, first, shown, asked)
    assert body["input"][-1] == {"type": "reasoning", "summary": [],
                                 "content": [{"type": "reasoning_text", "text": "Light scatters"}]}
    assert len(body["input"]) == 2
    events = read(second.feed(sse(
        *opened("resp_B"), item("reasoning", "rs_B", summary=[]), thought("rs_B", "Light scatters"),
        thought("rs_B", " blue."), {"type": "response.output_item.done", "item": {"type": "reasoning", "id": "rs_B"}},
        item("message", "msg_B", role="assistant", content=[]), text("msg_B", "Blue."))))
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.reasoning_text.delta", " blue."), ("response.output_item.done", None),
        ("response.output_item.added", None), ("response.output_text.delta", "Blue.")]
    assert events[0]["item_id"] == events[1]["item"]["id"] == "rs_A"  # the client's reasoning item, closed
    assert events[2]["item"]["id"] == "msg_B" and shown.kinds == {"reasoning": "rs_A", "text": "msg_B"}


def test_a_responses_call_under_way_is_made_again_and_shown_only_what_its_client_lacks() -> None:
    shown = Shown()
    first = first_part(RESPONSES, shown)
    first.feed(sse(*opened("resp_A"), item("message", "msg_A", role="assistant", content=[]),
                   text("msg_A", "Reading."),
                   item("function_call", "fc_A", call_id="call_A", name="read_file", arguments=""),
                   arguments("fc_A", '{"path": '), arguments("fc_A", '"READ')))
    assert first.part.calls == {0: Call("call_A", "read_file", '{"path": "READ')}
    assert shown.calls == [("fc_A", "call_A")]
    asked = {"input": "read it", "tools": [{"type": "function", "name": "read_file"}], "stream": True}
    second, body = next_part(RESPONSES, first, shown, asked)
    assert body == asked  # made again from the start
    events = read(second.feed(sse(
        *opened("resp_B"), item("message", "msg_B", role="assistant", content=[]), text("msg_B", "Reading."),
        item("function_call", "fc_B", call_id="call_B", name="read_file", arguments=""),
        arguments("fc_B", '{"path": '), arguments("fc_B", '"README.md"}'),
        {"type": "response.function_call_arguments.done", "item_id": "fc_B", "arguments": '{"path": "README.md"}'},
        {"type": "response.output_item.done", "item": {"type": "function_call", "id": "fc_B", "call_id": "call_B",
                                                       "name": "read_file", "arguments": '{"path": "README.md"}'}},
        item("function_call", "fc_C", call_id="call_C", name="read_file", arguments=""),
        arguments("fc_C", "{}"))))
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.function_call_arguments.delta", 'ME.md"}'), ("response.function_call_arguments.done", None),
        ("response.output_item.done", None), ("response.output_item.added", None),
        ("response.function_call_arguments.delta", "{}")]
    assert events[0]["item_id"] == events[1]["item_id"] == "fc_A"
    assert (events[2]["item"]["id"], events[2]["item"]["call_id"]) == ("fc_A", "call_A")  # one call, its ids
    assert events[3]["item"]["id"] == "fc_C" and shown.calls == [("fc_A", "call_A"), ("fc_C", "call_C")]
    assert second.part.calls[0] == Call("call_A", "read_file", 'ME.md"}')
    assert second.part.calls[1] == Call("call_C", "read_file", "{}")


# -- Messages ----------------------------------------------------------------------------------------------------


def started(id: str) -> dict[str, Any]:
    return {"type": "message_start", "message": {"id": id, "role": "assistant", "content": [],
                                                  "usage": {"input_tokens": 30, "output_tokens": 0}}}


def block(index: int, kind: str, **more: Any) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": {"type": kind, **more}}


def piece(index: int, kind: str, key: str, value: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": {"type": kind, key: value}}


def test_a_messages_answer_cut_goes_on_in_the_clients_blocks() -> None:
    """Cut in a tool_use block: the answer is made again from the start, and shown in the client's blocks only what
    it lacks — the rest of the call, then a call it never saw under the next index."""
    shown = Shown()
    first = first_part(MESSAGES, shown)
    first.feed(sse(started("msg_A"), block(0, "thinking", thinking=""),
                   piece(0, "thinking_delta", "thinking", "Light scatters."),
                   block(1, "text", text=""), piece(1, "text_delta", "text", "The sky"),
                   block(2, "tool_use", id="toolu_A", name="look", input={}),
                   piece(2, "input_json_delta", "partial_json", '{"at": "u')))
    assert (first.part.content, first.part.reasoning) == (["The sky"], ["Light scatters."])
    assert (shown.id, shown.kinds, shown.calls, shown.blocks) == ("msg_A", {"reasoning": 0, "text": 1}, [2], 3)
    asked = {"messages": [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "The"}],
             "max_tokens": 50, "stream": True}
    second, body = next_part(MESSAGES, first, shown, asked)
    assert body == asked
    events = read(second.feed(sse(
        started("msg_B"), block(0, "thinking", thinking=""), piece(0, "thinking_delta", "thinking", "Light scatters."),
        block(1, "text", text=""), piece(1, "text_delta", "text", "The sky"),
        block(2, "tool_use", id="toolu_B", name="look", input={}),
        piece(2, "input_json_delta", "partial_json", '{"at": "up"}'),
        block(3, "tool_use", id="toolu_C", name="look", input={}),
        piece(3, "input_json_delta", "partial_json", "{}"),
        {"type": "content_block_stop", "index": 0}, {"type": "content_block_stop", "index": 3},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 4}},
        {"type": "message_stop"})))
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_delta", 2), ("content_block_start", 3), ("content_block_delta", 3),
        ("content_block_stop", 0), ("content_block_stop", 3), ("message_delta", None), ("message_stop", None)]
    assert events[0]["delta"]["partial_json"] == 'p"}' and events[1]["content_block"]["id"] == "toolu_C"
    assert events[5]["usage"]["output_tokens"] == 4  # made again whole: its own count is the whole answer's


def test_a_messages_block_the_client_never_saw_takes_the_next_index() -> None:
    shown = Shown()
    first = first_part(MESSAGES, shown)
    first.feed(sse(started("msg_A"), block(0, "text", text=""), piece(0, "text_delta", "text", "Let me look.")))
    second, _ = next_part(MESSAGES, first, shown, {"messages": [{"role": "user", "content": "go"}], "stream": True})
    events = read(second.feed(sse(
        started("msg_B"), block(0, "thinking", thinking=""), piece(0, "thinking_delta", "thinking", "hm"),
        block(1, "text", text=""), piece(1, "text_delta", "text", "Let me look. Now."))))
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 0)]
    assert events[2]["delta"]["text"] == " Now."
