"""The answer loop alone: its passes to llama-server, the growth and the loss of the server are scripted (answers in
llama-server's shapes, passed through the `catching` rule as wrapper/answers/proxy.py's catch does), so that every
path of an overflow, a continuation, a lost server and a pause is seen without a server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web

from wrapper.answers.answering import MAX_GROWTHS, AnswerLoop
from wrapper.answers.apis.chat import Chat
from wrapper.answers.calls import Written
from wrapper.answers.events import Events
from wrapper.answers.proxy import Catching, Outcome, Pass
from wrapper.answers.route import Shape
from wrapper.configuration.config import parse_config
from wrapper.configuration.sections import WATCHDOG
from wrapper.server.generation import Host
from wrapper.serving import GONE_WHY, Loss
from wrapper.steps import CannotGrow, Grown, GrowResult, Growth, NotPlanned

CHAT = "/v1/chat/completions"
N_CTX = 512


def overflow(prompt: int) -> tuple[int, dict[str, Any]]:
    return 400, {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": prompt,
                           "n_ctx": N_CTX, "message": "the request exceeds the available context size"}}


def chat(text: str, finish: str = "stop", prompt: int = 100, completion: int = 10) -> tuple[int, dict[str, Any]]:
    return 200, {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                 "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}}


@dataclass
class Script:
    """llama-server's answers in turn, and what the loop sent; an answer `catching` does not keep goes through."""

    answers: list[tuple[int, dict[str, Any]] | str]  # a str: llama-server went away under that pass
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, body: bytes, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        self.sent.append(json.loads(body))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, str):
            return Pass(Outcome.CUT, REQUEST, error=answer)
        status, payload = answer
        if catching(payload, status):
            return Pass(Outcome.CAUGHT, REQUEST, status=status, payload=payload)
        return Pass(Outcome.ANSWERED, REQUEST, web.json_response(payload, status=status))


# the client's request: never closed here
REQUEST = cast(web.BaseRequest, SimpleNamespace(transport=None, path="/v1/chat/completions"))


@dataclass
class Growing:
    results: list[GrowResult]
    asked: list[int] = field(default_factory=list)

    async def grow(self, host: Host, needed: int, pool_full: bool) -> GrowResult:
        self.asked.append(needed)
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]


@dataclass
class Losing:
    """Whether the server was lost under each cut pass (and another serves): in turn."""

    answers: list[Loss]
    asked: int = 0

    async def lost(self) -> Loss:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


@dataclass
class Passes:
    """The loop's passes: the script's answers, and whether the server was lost under each cut."""

    script: Script
    losing: Losing | None

    async def send(self, body: bytes, shape: Shape, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        assert shape is Shape.WHOLE and events is None
        return await self.script.send(body, catching, events, going_on)

    async def lost(self) -> Loss:
        assert self.losing is not None  # asked only with the watchdog on
        return await self.losing.lost()

    async def resume(self, request: dict[str, Any], generated: int) -> bytes | str:
        raise AssertionError("a whole answer is never paused")

    async def written(self, name: str, text: str, arguments: str, generated: int | None) -> Written | None:
        raise AssertionError("a whole answer's call is not continued")


def loop(script: Script, growing: Growing | None, body: dict[str, Any], continues: bool = True,
         losing: Losing | None = None) -> AnswerLoop:
    host = cast(Host, SimpleNamespace(current=SimpleNamespace(config=None)))
    growth = Growth(growing.grow, lambda config: continues, lambda config: 64) if growing is not None else None
    return AnswerLoop(host, growth, Chat(), CHAT, json.dumps(body).encode(), Passes(script, losing), lambda: N_CTX,
                      Shape.WHOLE, watched=losing is not None)


def answer(response: web.StreamResponse) -> dict[str, Any]:
    assert isinstance(response, web.Response) and response.body is not None
    return cast(dict[str, Any], json.loads(cast(bytes, response.body)))


ASKED = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 32}


async def test_an_overflow_grows_and_sends_the_request_again() -> None:
    script, growing = Script([overflow(600), chat("hi there")]), Growing([Grown()])
    response = await loop(script, growing, ASKED).run()
    assert response.status == 200 and answer(response)["choices"][0]["message"]["content"] == "hi there"
    assert growing.asked == [600 + 32]  # the prompt and what the request may generate
    assert script.sent == [ASKED, ASKED]


async def test_without_max_tokens_the_growth_leaves_the_headroom() -> None:
    growing = Growing([Grown()])
    await loop(Script([overflow(600), chat("ok")]), growing, {"messages": ASKED["messages"]}).run()
    assert growing.asked == [600 + 64]


async def test_a_growth_that_cannot_be_made_says_why_in_llama_servers_refusal() -> None:
    script, growing = Script([overflow(9000)]), Growing([CannotGrow("the largest context is 4096 tokens")])
    response = await loop(script, growing, ASKED).run()
    error = answer(response)["error"]
    assert response.status == 400 and error["type"] == "exceed_context_size_error"
    assert error["message"].startswith("the largest context is 4096 tokens (the request exceeds")
    assert len(script.sent) == 1


async def test_no_plan_to_grow_with_leaves_the_refusal_as_it_was() -> None:
    response = await loop(Script([overflow(9000)]), Growing([NotPlanned()]), ASKED).run()
    assert answer(response)["error"]["message"] == "the request exceeds the available context size"


async def test_an_overflow_after_every_growth_is_the_last_refusal_and_no_growth_more() -> None:
    script, growing = Script([overflow(600)]), Growing([Grown()])
    response = await loop(script, growing, ASKED).run()
    assert response.status == 400 and len(script.sent) == MAX_GROWTHS + 1 and len(growing.asked) == MAX_GROWTHS


async def test_an_answer_cut_by_a_full_context_goes_on_after_a_growth_as_one_answer() -> None:
    cut = chat("Once upon", finish="length", prompt=500, completion=11)  # 511 of 512: the context stopped it
    script, growing = Script([cut, chat("Once upon a time.", prompt=520, completion=5)]), Growing([Grown()])
    response = await loop(script, growing, ASKED).run()
    merged = answer(response)
    assert merged["choices"][0]["message"]["content"] == "Once upon a time."
    assert merged["usage"]["completion_tokens"] == 16 and growing.asked == [511 + 21]
    again = script.sent[1]
    assert again["messages"][-1] == {"role": "assistant", "content": "Once upon"} and again["max_tokens"] == 21


async def test_an_answer_its_own_limit_stopped_is_not_continued() -> None:
    script, growing = Script([chat("short", finish="length", prompt=100, completion=32)]), Growing([Grown()])
    response = await loop(script, growing, ASKED).run()
    assert answer(response)["choices"][0]["finish_reason"] == "length" and growing.asked == []


async def test_without_continue_a_cut_answer_is_the_clients_as_it_came() -> None:
    cut = chat("Once upon", finish="length", prompt=500, completion=11)
    script, growing = Script([cut]), Growing([Grown()])
    response = await loop(script, growing, ASKED, continues=False).run()
    assert answer(response)["choices"][0]["message"]["content"] == "Once upon" and growing.asked == []


async def test_a_continuation_that_cannot_grow_answers_what_came() -> None:
    cut = chat("Once upon", finish="length", prompt=500, completion=11)
    script, growing = Script([cut]), Growing([CannotGrow("no room")])
    response = await loop(script, growing, ASKED).run()
    assert answer(response)["choices"][0]["message"]["content"] == "Once upon" and len(script.sent) == 1



async def test_a_request_the_server_was_lost_under_is_sent_again_to_the_next_one() -> None:
    script, losing = Script(["Server disconnected", chat("after the restart")]), Losing([Loss.BACK])
    response = await loop(script, None, ASKED, losing=losing).run()
    assert answer(response)["choices"][0]["message"]["content"] == "after the restart"
    assert script.sent == [ASKED, ASKED] and losing.asked == 1


async def test_a_cut_with_no_server_lost_is_the_clients_502() -> None:
    script, losing = Script(["Connection refused"]), Losing([Loss.NONE])
    response = await loop(script, None, ASKED, losing=losing).run()
    assert response.status == 502 and "Connection refused" in answer(response)["error"]["message"]
    assert len(script.sent) == 1


async def test_a_request_in_flight_at_two_losses_is_not_sent_a_third_time() -> None:
    script, losing = Script(["Server disconnected"]), Losing([Loss.BACK])
    response = await loop(script, None, ASKED, losing=losing).run()
    error = answer(response)["error"]
    assert response.status == 502 and "lost 2 times while it served this request" in error["message"]
    assert len(script.sent) == 2


async def test_without_the_watchdog_a_cut_is_a_502_and_nothing_is_sent_again() -> None:
    script = Script(["Server disconnected"])
    response = await loop(script, None, ASKED).run()
    assert response.status == 502 and len(script.sent) == 1


async def test_a_server_lost_and_not_started_again_is_said_so() -> None:
    script, losing = Script(["Server disconnected"]), Losing([Loss.GONE])
    response = await loop(script, None, ASKED, losing=losing).run()
    assert response.status == 502 and answer(response)["error"]["message"] == GONE_WHY
    assert len(script.sent) == 1


# -- a stream: passes scripted as llama-server's events, written to a recorded client ----------------------------


class Client:
    """The client's response: what was written to it, once prepared."""

    prepared = True
    content_type = "text/event-stream"

    def __init__(self) -> None:
        self.written = b""
        self.ended = False

    async def write(self, data: bytes) -> None:
        assert not self.ended
        self.written += data

    async def write_eof(self) -> None:
        self.ended = True

    def events(self) -> list[dict[str, Any]]:
        return [{"done": True} if line == "data: [DONE]" else json.loads(line[6:])
                for line in self.written.decode().split("\n\n") if line.startswith("data: ")]


def sse(*payloads: dict[str, Any] | str) -> bytes:
    return b"".join(b"data: " + (p.encode() if isinstance(p, str) else json.dumps(p).encode()) + b"\n\n"
                    for p in payloads)


def delta(content: str | None = None, id: str = "chatcmpl-1", **more: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": None, "delta": {"content": content, **more}}], "id": id,
            "object": "chat.completion.chunk"}


def final(id: str = "chatcmpl-1", completion: int = 3) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}], "id": id,
            "usage": {"completion_tokens": completion, "prompt_tokens": 50, "total_tokens": 50 + completion}}


@dataclass
class Streams:
    """llama-server's event streams in turn, each to its end, or cut (`cut`) or paused after `upto` events; the
    loop's passes (wrapper/answers/passes.py) played against them."""

    parts: list[tuple[bytes, str | None, int]]  # (the stream, "cut" | "paused" | None, events before it)
    client: Client = field(default_factory=Client)
    sent: list[dict[str, Any]] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=lambda: [Loss.BACK])
    resumes: list[bytes | str] = field(default_factory=list)
    opening: str | None = None  # how the template writes a call before its arguments (None: not known)

    async def send(self, body: bytes, shape: Shape, catching: Catching, events: Events | None,
                   going_on: web.StreamResponse | None) -> Pass:
        assert shape is Shape.STREAM and events is not None
        self.sent.append(json.loads(body))
        stream, stop, upto = self.parts.pop(0)
        raws = [raw + b"\n\n" for raw in stream.split(b"\n\n") if raw]
        response = cast(web.StreamResponse, self.client)
        for raw in raws[:upto] if stop else raws:
            await self.client.write(events.feed(raw))
        if stop == "cut":
            return Pass(Outcome.CUT, REQUEST, response, error="Server disconnected")
        if stop == "paused":
            return Pass(Outcome.PAUSED, REQUEST, response)
        if events.held:
            return Pass(Outcome.HELD, REQUEST, response, 200, events=events)
        await self.client.write_eof()  # as wrapper/answers/proxy.py ends a stream it held nothing of
        return Pass(Outcome.ANSWERED, REQUEST, response)

    async def lost(self) -> Loss:
        return self.losses.pop(0)

    async def resume(self, request: dict[str, Any], generated: int) -> bytes | str:
        return self.resumes.pop(0)

    async def written(self, name: str, text: str, arguments: str, generated: int | None) -> Written | None:
        if self.opening is None:
            return None
        prefill = text + self.opening.replace("NAME", name) + arguments
        return Written(prefill, len(prefill.split()), True)  # a token per word, as a tokenizer might count


def streamed(streams: Streams, prompt: int | None = None, **more: Any) -> AnswerLoop:
    body = {**ASKED, "stream": True, "temperature": 0, **more}
    host = cast(Host, SimpleNamespace(current=SimpleNamespace(config=parse_config("", "t.yaml"))))
    return AnswerLoop(host, None, Chat(), CHAT, json.dumps(body).encode(), streams, lambda: N_CTX, Shape.STREAM,
                      watched=True, prompt_tokens=prompt)


FIRST = sse(delta(None, role="assistant"), delta("Once"), delta(" upon"), delta(" a"), delta(" time"))
AFTER = sse(delta(None, role="assistant", id="chatcmpl-2"), delta("Once upon a", id="chatcmpl-2"),
            delta(" time", id="chatcmpl-2"), delta(",", id="chatcmpl-2"), delta(" there", id="chatcmpl-2"),
            final("chatcmpl-2", completion=3), "[DONE]")


def text(client: Client) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in client.events() if "choices" in e)


async def test_a_stream_cut_by_a_lost_server_goes_on_in_the_same_stream_as_one_answer() -> None:
    streams = Streams([(FIRST, "cut", 5), (AFTER, None, 0)])
    response = await streamed(streams).run()
    assert response is streams.client and streams.client.ended  # type: ignore[comparison-overlap]
    events = streams.client.events()
    assert text(streams.client) == "Once upon a time, there"  # picked up where it stopped: nothing again
    assert sum(1 for e in events if "choices" in e and e["choices"][0]["delta"].get("role")) == 1
    assert {e["id"] for e in events if "id" in e} == {"chatcmpl-1"}  # the first part's id throughout
    finals = [e for e in events if "choices" in e and e["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and events[-1] == {"done": True}
    assert finals[0]["usage"]["completion_tokens"] == 6  # 4 before the cut, 3 after, " time" once
    went_on = streams.sent[1]["messages"][-1]
    assert went_on == {"role": "assistant", "content": "Once upon a"}  # from before the last word


def handing_over(streams: Streams) -> Streams:
    """`streams` whose cuts are a reload's hand-over, not a loss."""
    cut = streams.send

    async def handed_over(*given: Any) -> Pass:
        got = await cut(*given)
        return Pass(got.outcome, got.request, got.response, error="handed over", handed_over=True) \
            if got.outcome is Outcome.CUT else got

    streams.send = handed_over  # type: ignore[method-assign,assignment]
    return streams


async def test_a_stream_a_reload_handed_over_goes_on_without_asking_for_a_loss() -> None:
    streams = handing_over(Streams([(FIRST, "cut", 5), (AFTER, None, 0)], losses=[]))
    await streamed(streams).run()
    assert text(streams.client) == "Once upon a time, there"


async def test_a_paused_stream_resumes_in_its_stream_and_one_refused_is_told_why() -> None:
    resumed = {**ASKED, "stream": True, "id_slot": 0}
    streams = Streams([(FIRST, "paused", 5), (AFTER, None, 0)], resumes=[json.dumps(resumed).encode()])
    await streamed(streams, prompt=50).run()
    assert text(streams.client) == "Once upon a time, there" and streams.sent[1] == resumed
    refused = Streams([(FIRST, "paused", 5)], resumes=["the slot could not be restored"])
    await streamed(refused).run()
    events = refused.client.events()
    assert events[-1]["error"]["message"] == "the slot could not be restored" and refused.client.ended
    assert not any("choices" in e and e["choices"][0]["finish_reason"] for e in events)


async def test_a_stream_cut_twice_by_losses_ends_with_an_error_event() -> None:
    streams = Streams([(FIRST, "cut", 5), (AFTER, "cut", 3)], losses=[Loss.BACK, Loss.BACK])
    await streamed(streams).run()
    events = streams.client.events()
    assert "lost 2 times" in events[-1]["error"]["message"] and streams.client.ended


def call(arguments: str, id: str = "chatcmpl-1", call_id: str | None = None) -> dict[str, Any]:
    piece: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
    if call_id is not None:
        piece.update(id=call_id, type="function", function={"name": "write_file", "arguments": arguments})
    return delta(None, id=id, tool_calls=[piece])


def length(id: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": "length", "delta": {}}], "id": id,
            "usage": {"completion_tokens": 9, "prompt_tokens": 50, "total_tokens": 59}}


CALL_CUT = sse(delta(None, role="assistant"), delta("Writing it."), call("{", call_id="call_a"),
               call('"path"'), call(': "a.txt",'), call(' "content"'), call(': "Once'), call(" upon"))
CALL_AFTER = sse(delta(None, role="assistant", id="chatcmpl-2"), delta("Writing it.", id="chatcmpl-2"),
                 call('{"path": "a.txt", "content": "Once upon', id="chatcmpl-2", call_id="call_b"),
                 call(" a", id="chatcmpl-2"), call(" time", id="chatcmpl-2"),
                 length("chatcmpl-2"), "[DONE]")


def calls_of(client: Client) -> list[dict[str, Any]]:
    return [c for e in client.events() if "choices" in e for c in e["choices"][0]["delta"].get("tool_calls") or []]


TOOLS = [{"type": "function", "function": {"name": "write_file"}}]
OPENS = '{"name": "NAME", "parameters": '


def one_call(streams: Streams) -> None:
    """The client saw one call, its first id and its name once, its arguments whole; the text before it once; the
    uncut answer's end."""
    parts = calls_of(streams.client)
    assert [c.get("id") for c in parts if c.get("id")] == ["call_a"]
    assert sum(1 for c in parts if c["function"].get("name")) == 1
    assert "".join(c["function"]["arguments"] for c in parts) == '{"path": "a.txt", "content": "Once upon a time'
    assert text(streams.client) == "Writing it."
    finals = [e for e in streams.client.events() if "choices" in e and e["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["length"]


async def test_a_call_that_samples_repeatably_is_generated_again_from_the_start() -> None:
    """Cut in a call's arguments, a greedy answer — or one with a seed, the client's or the wrapper's own — is asked
    again as it came (the same messages, the same limit): generated again it is the uncut answer, and the client
    is shown only what it lacks (the text by count, the call's arguments after its own)."""
    cases: list[dict[str, Any]] = [{}, {"temperature": 0.7, "seed": 42}, {"temperature": 0.7}]
    for more in cases:
        streams = Streams([(CALL_CUT, "cut", 8), (CALL_AFTER, None, 0)], opening=OPENS)
        await streamed(streams, tools=TOOLS, max_tokens=40, **more).run()
        first, again = streams.sent
        assert again == first and again["max_tokens"] == 40, more
        assert "temperature" not in more or isinstance(again.get("seed"), int), more  # sampled: seeded
        one_call(streams)


async def test_a_call_that_runs_long_samples_unseeded_or_is_handed_over_goes_on_from_its_arguments() -> None:
    """Past watchdog.replay_tokens (each token generated again is a decode step), sampling from a seed llama-server
    does not repeat (-1: a random one), or handed over by a reload (the next server may compute other numbers: its
    KV precision, its build), the answer goes on from its text, the template's markup for the call and all the
    arguments the client has: the call opens again there and the client sees one call, its id and name once, its
    arguments whole, the limit less what the prefill holds."""
    prefill = 'Writing it.{"name": "write_file", "parameters": {"path": "a.txt", "content": "Once upon'
    long = Streams([(CALL_CUT, "cut", 8), (CALL_AFTER, None, 0)], opening=OPENS)
    loop = streamed(long, tools=TOOLS, max_tokens=40)
    loop.host.current.config = parse_config("watchdog: {replay_tokens: 3}", "t.yaml", (WATCHDOG,))
    await loop.run()
    unseeded = Streams([(CALL_CUT, "cut", 8), (CALL_AFTER, None, 0)], opening=OPENS)
    await streamed(unseeded, tools=TOOLS, max_tokens=40, temperature=0.7, seed=-1).run()
    handed = handing_over(Streams([(CALL_CUT, "cut", 8), (CALL_AFTER, None, 0)], opening=OPENS, losses=[]))
    await streamed(handed, tools=TOOLS, max_tokens=40).run()
    for streams in (long, unseeded, handed):
        went_on = streams.sent[1]
        assert went_on["messages"][-1] == {"role": "assistant", "content": prefill}
        assert went_on["max_tokens"] == 40 - len(prefill.split())
        one_call(streams)


async def test_a_call_whose_markup_is_not_known_is_made_again_from_the_start() -> None:
    streams = Streams([(CALL_CUT, "cut", 8), (CALL_AFTER, None, 0)])
    loop = streamed(streams, tools=TOOLS, max_tokens=40)
    loop.host.current.config = parse_config("watchdog: {replay_tokens: 0}", "t.yaml", (WATCHDOG,))
    await loop.run()
    assert streams.sent[1]["messages"] == streams.sent[0]["messages"] and streams.sent[1]["max_tokens"] == 40
    one_call(streams)
