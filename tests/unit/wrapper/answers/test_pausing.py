"""A background answer paused and resumed, without a server: where a resume goes on from, the request that goes on,
a JSON answer gathered from a stream, and the answer loop with its passes, pauses and resumes scripted."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web

from wrapper.answers.answering import AnswerLoop
from wrapper.answers.apis.chat import Chat
from wrapper.answers.apis.completion import Completion
from wrapper.answers.calls import Written
from wrapper.answers.continuation import RESUME_LOOKBACK, SoFar, greedy, resume_point
from wrapper.answers.events import Events
from wrapper.answers.part import Carry, Had, Part
from wrapper.answers.proxy import Catching, Outcome, Pass
from wrapper.answers.route import Shape
from wrapper.server.generation import Host
from wrapper.serving import Loss

CHAT = "/v1/chat/completions"


def test_a_resume_goes_on_from_before_the_last_word() -> None:
    assert resume_point(["Once", " upon", " a", " time", ".\n\n"]) == 3  # " time" and ".\n\n" come again
    assert resume_point(["Once", " upon", " a", " time"]) == 3
    assert resume_point(["Once"]) == 0  # nothing begins a word after the first token: all of it again
    assert resume_point(["\n"]) == 0  # "\n" read back after the template's newline is "\n\n": not a prefix
    assert resume_point([]) == 0
    assert resume_point(["x", "  ", " \n"]) == 0  # spaces alone do not begin a word
    assert resume_point(["a", " b", *["c"] * RESUME_LOOKBACK]) == RESUME_LOOKBACK + 2  # too far back: the end


def test_only_a_greedy_request_generates_again() -> None:
    assert greedy({"temperature": 0}) and greedy({"temperature": 0.0}) and greedy({"top_k": 1})
    assert not greedy({}) and not greedy({"temperature": 0.7}) and not greedy({"temperature": False})


def test_the_request_that_goes_on_and_the_text_it_gives_first() -> None:
    asked = {"messages": [{"role": "user", "content": "tell"}], "max_tokens": 10, "temperature": 0}
    so_far = SoFar(Chat())
    assert so_far.going_on(asked, True) == (asked, Had())  # nothing yet: the request as it was
    so_far.pieces += ["Once", " upon", " a", " time", "."]
    body, had = so_far.going_on(asked, True)
    assert body["messages"][-1] == {"role": "assistant", "content": "Once upon a"}
    assert body["max_tokens"] == 7 and (had.text, had.again) == ("Once upon a", 2)  # the echo, 2 generated again
    body, had = so_far.going_on(asked, False)
    assert body["messages"][-1]["content"] == "Once upon a time." and body["max_tokens"] == 5 and had.again == 0
    completion = SoFar(Completion(), pieces=["Once", " upon", " a", " time"])
    body, had = completion.going_on({"prompt": "Tell: ", "n_predict": 8}, True)
    assert body["prompt"] == "Tell: Once upon a" and body["n_predict"] == 5 and (had.text, had.again) == ("", 1)


def test_what_a_resume_generates_again_is_not_shown_even_when_it_differs() -> None:
    same = Events(Chat(), Part(Had("Once upon a", 2), continuing=True))
    shown = same.feed(sse(delta(None, role="assistant"), delta("Once upon a"), delta(" time"), delta("."),
                          delta(" There")))
    assert same.part.content == [" There"] and b"There" in shown and b"time" not in shown
    other = Events(Chat(), Part(Had("Once upon a", 2), continuing=True))
    other.feed(sse(delta("Once upon a"), delta(" day"), delta("!"), delta(" It")))
    assert other.part.content == [" It"]  # the client's "time." stands; no "day!" after it
    merged = Events(Chat(), Part(Had("Once upon a", 1), continuing=True))
    merged.feed(sse(delta("Once upon a time"), delta(".")))  # the echo and a token in one event
    assert merged.part.content == ["."]
    completion = Events(Completion(), Part(Had(again=1), continuing=True))
    completion.feed(sse({"content": " time", "stop": False}, {"content": ".", "stop": False}))
    assert completion.part.content == ["."] and completion.tokens == 1


def sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(p).encode() + b"\n\n" for p in payloads)


def delta(content: str | None = None, **more: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": {"content": content, **more}}],
            "id": "chatcmpl-1", "created": 7, "model": "m", "object": "chat.completion.chunk"}


def final(reason: str = "stop", cache_n: int = 40, prompt_n: int = 2, predicted_n: int = 3) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": reason, "delta": {}}], "id": "chatcmpl-1", "created": 7,
            "model": "m", "object": "chat.completion.chunk",
            "timings": {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": predicted_n}}


def test_a_resumed_part_carries_the_whole_answers_id_and_counts() -> None:
    carry = Carry("chatcmpl-first", shown=100, again=2, prompt_tokens=40)
    events = Events(Chat(), Part(continuing=True), holds=False, carry=carry)
    shown = events.feed(sse(delta("x") | {"id": "chatcmpl-second"},
                            final() | {"usage": {"completion_tokens": 52, "prompt_tokens": 138, "total_tokens": 190}}))
    passed = [json.loads(line[5:]) for line in shown.decode().split("\n\n") if line.startswith("data:")]
    assert {p["id"] for p in passed} == {"chatcmpl-first"}
    assert passed[-1]["usage"] == {"completion_tokens": 150, "prompt_tokens": 40, "total_tokens": 190}
    unknown = Carry(None, shown=100, again=2)  # no prompt count: the part's prompt less what it went on from
    usage = {"usage": {"completion_tokens": 52, "prompt_tokens": 138}}
    assert Chat().carried(usage, unknown) and usage["usage"]["prompt_tokens"] == 40
    last = {"stop": True, "tokens_predicted": 52, "tokens_evaluated": 139, "prompt": "Tell: Once upon"}
    assert Completion().carried(last, Carry(None, 100, 2, 41, "Tell: "))
    assert last == {"stop": True, "tokens_predicted": 150, "tokens_evaluated": 41, "prompt": "Tell: "}


def test_a_gathered_stream_is_llama_servers_json_answer() -> None:
    events = Events(Chat(), passes_on=False)
    events.feed(sse(delta(None, role="assistant"), delta(reasoning_content="think"), delta("Hi"), delta(" you")))
    events.feed(sse(delta(tool_calls=[{"index": 0, "id": "c1", "type": "function",
                                       "function": {"name": "f", "arguments": "{\"a\""}}]),
                    delta(tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]), final("tool_calls")))
    events.feed(b"data: [DONE]\n\n")
    assert not events.plain
    so_far = SoFar(Chat())
    so_far.took(events.part)
    answer = Chat().gathered(events.part, so_far, 42, {})
    assert answer["choices"] == [{"finish_reason": "tool_calls", "index": 0, "message": {
        "role": "assistant", "content": "Hi you", "reasoning_content": "think",
        "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]
    assert answer["usage"] == {"completion_tokens": 5, "prompt_tokens": 42, "total_tokens": 47,
                               "prompt_tokens_details": {"cached_tokens": 40}}
    assert answer["id"] == "chatcmpl-1" and answer["object"] == "chat.completion" and answer["timings"]


def test_a_gathered_completion_is_its_last_event_with_the_whole_text() -> None:
    events = Events(Completion(), passes_on=False)
    events.feed(sse({"content": " a", "stop": False}, {"content": "", "stop": True, "tokens_predicted": 1,
                                                          "prompt": "Tell: Once", "timings": {"predicted_n": 1}}))
    answer = Completion().gathered(events.part, SoFar(Completion(), pieces=["Once", " a"]), None, {"prompt": "Tell: "})
    assert answer["content"] == "Once a" and answer["tokens_predicted"] == 2 and answer["prompt"] == "Tell: "


@dataclass
class Passes:
    """llama-server's streams in turn, each cut short by a pause after `pause_after` events, or to its end."""

    streams: list[tuple[bytes, int | None]]
    sent: list[dict[str, Any]] = field(default_factory=list)
    resumed: list[tuple[dict[str, Any], int]] = field(default_factory=list)
    request: web.BaseRequest = field(default_factory=lambda: cast(web.BaseRequest, None))

    async def send(self, body: bytes, shape: Shape, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        assert shape is Shape.GATHERED and events is not None and going_on is None
        self.sent.append(json.loads(body))
        stream, pause_after = self.streams.pop(0)
        if pause_after is None:
            events.feed(stream)
            return Pass(Outcome.GATHERED, self.request, events=events)
        for raw in stream.split(b"\n\n")[:pause_after]:
            events.feed(raw + b"\n\n")
        return Pass(Outcome.PAUSED, self.request)

    async def lost(self) -> Loss:
        raise AssertionError("nothing is cut")

    async def written(self, name: str, text: str, arguments: str, generated: int | None) -> Written | None:
        raise AssertionError("nothing is cut")

    async def resume(self, request: dict[str, Any], generated: int) -> bytes | str:
        self.resumed.append((request, generated))
        return json.dumps({**request, "id_slot": 1}).encode()


async def test_a_json_answer_paused_twice_is_one_answer() -> None:
    asked = {"messages": [{"role": "user", "content": "tell"}], "max_tokens": 20, "temperature": 0}
    first = sse(delta(None, role="assistant"), delta("Once"), delta(" upon"), delta(" a"), delta(" time"))
    second = sse(delta(None, role="assistant"), delta("Once upon a"), delta(" time"), delta(","), delta(" there"))
    third = sse(*({**e, "id": "chatcmpl-3"} for e in (
        delta(None, role="assistant"), delta("Once upon a time,"), delta(" there"), delta(" was"),
        final(cache_n=36, prompt_n=1, predicted_n=3))))
    passes = Passes([(first, 5), (second, 5), (third, None)])
    host = cast(Host, SimpleNamespace(current=SimpleNamespace(config=None)))
    response = await AnswerLoop(host, None, Chat(), CHAT, json.dumps(asked).encode(), passes, lambda: 4096,
                                Shape.GATHERED, prompt_tokens=30).run()
    assert isinstance(response, web.Response) and response.body is not None
    answer = json.loads(cast(bytes, response.body))
    assert answer["choices"][0]["message"]["content"] == "Once upon a time, there was"
    assert answer["id"] == "chatcmpl-1"  # the answer's first part's
    assert answer["usage"]["completion_tokens"] == 7 and answer["usage"]["prompt_tokens"] == 30
    assert all(sent["stream"] is True for sent in passes.sent)  # asked as JSON, sent as a stream
    assert passes.resumed[0][0]["messages"][-1] == {"role": "assistant", "content": "Once upon a"}
    assert passes.resumed[0][0]["max_tokens"] == 17 and passes.resumed[0][1] == 4
    assert passes.resumed[1][0]["messages"][-1] == {"role": "assistant", "content": "Once upon a time,"}
    assert passes.sent[1]["id_slot"] == 1
