"""The answer loop alone: its exchange with llama-server, the growth and the loss of the server are scripted
(answers in llama-server's shapes, passed through `wanted` as wrapper/proxy.py's catch does), so that every path
of an overflow, a continuation and a lost server is seen without a server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web

from wrapper.answering import MAX_GROWTHS, AnswerLoop
from wrapper.generation import Host
from wrapper.proxy import Caught, Cut, Held, Wanted
from wrapper.serving import GONE_WHY, Loss
from wrapper.sse import Events
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
    """llama-server's answers in turn, and what the loop sent; an answer `wanted` does not keep goes through."""

    answers: list[tuple[int, dict[str, Any]] | str]  # a str: llama-server went away under that pass
    sent: list[dict[str, Any]] = field(default_factory=list)

    async def exchange(self, body: bytes, wanted: Wanted, events: Events | None,
                       going_on: web.StreamResponse | None) -> web.StreamResponse | Caught | Held | Cut:
        self.sent.append(json.loads(body))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, str):
            return Cut(answer, cast(web.BaseRequest, None))
        status, payload = answer
        if wanted(payload, status):
            return Caught(status, payload)
        return web.json_response(payload, status=status)


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


def loop(script: Script, growing: Growing | None, body: dict[str, Any], continues: bool = True,
         losing: Losing | None = None) -> AnswerLoop:
    host = cast(Host, SimpleNamespace(current=SimpleNamespace(config=None)))
    growth = Growth(growing.grow, lambda config: continues, lambda config: 64) if growing is not None else None
    return AnswerLoop(host, growth, CHAT, json.dumps(body).encode(), script.exchange, lambda: N_CTX,
                      losing.lost if losing is not None else None)


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
