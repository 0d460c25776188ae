"""The slots' queue alone: interactive requests first, first come first served within a class, a paused request
keeps its place, and which background seat is asked to pause."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from structlog.testing import capture_logs

from wrapper.asked import Asked, Class
from wrapper.metrics import METRICS
from wrapper.queue.seats import BEGUN, BETWEEN, INTERACTIVE, Seat, Seats, Why
from wrapper.steps import SlotUse

PERSON, AGENT = Class.INTERACTIVE, Class.BACKGROUND


def seat(klass: Class, arrived: float, tokens: int = 0) -> Seat:
    return Seat(Asked("/v1/chat/completions", klass=klass), arrived=arrived, use=SlotUse(tokens=tokens))


@dataclass
class Running:
    """An exchange under way that a seat may be paused from: how far it got."""

    tokens: int = 0
    plain: bool = True


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_interactive_requests_go_first_then_first_come_first_served() -> None:
    seats = Seats(1)
    first = seat(AGENT, 0.0)
    await seats.take(first)
    order: list[str] = []

    async def wait(name: str, s: Seat) -> None:
        await seats.take(s)
        order.append(name)

    waiting = [seat(AGENT, 1.0), seat(PERSON, 2.0), seat(AGENT, 3.0), seat(PERSON, 4.0)]
    tasks = [asyncio.ensure_future(wait(n, s)) for n, s in zip(("b1", "i1", "b2", "i2"), waiting, strict=True)]
    await settle()
    assert order == []
    assert [s["class"] for s in seats.status()["waiting"]] == ["interactive", "interactive", "background",
                                                              "background"]
    holder = first
    for _ in waiting:
        seats.leave(holder)
        await settle()
        holder = next(s for s in waiting if s in seats.running)
    assert order == ["i1", "i2", "b1", "b2"]
    await asyncio.gather(*tasks)


async def test_a_paused_request_waits_ahead_of_later_background_ones() -> None:
    seats = Seats(1)
    paused = seat(AGENT, 0.0)
    await seats.take(paused)
    later = seat(AGENT, 5.0)
    later_task = asyncio.ensure_future(seats.take(later))
    seats.leave(paused)  # paused: it waits again with its first arrival
    await settle()
    assert later in seats.running
    again = asyncio.ensure_future(seats.take(paused))
    third = asyncio.ensure_future(seats.take(seat(AGENT, 6.0)))
    await settle()
    seats.leave(later)
    await settle()
    assert again.done() and not third.done()
    third.cancel()
    await asyncio.gather(later_task, again)


async def test_a_waiter_that_gives_up_leaves_the_queue() -> None:
    seats = Seats(1)
    await seats.take(seat(AGENT, 0.0))
    gone = asyncio.ensure_future(seats.take(seat(PERSON, 1.0)))
    await settle()
    assert len(seats.waiting) == 1
    gone.cancel()
    await settle()
    assert seats.waiting == []


async def test_an_interactive_request_asks_the_cheapest_pausable_background_seat() -> None:
    seats = Seats(3)
    seats.preempt = True
    big, small, busy, person = seat(AGENT, 0.0, 900), seat(AGENT, 1.0, 100), seat(AGENT, 2.0, 50), seat(PERSON, 3.0, 10)
    for s in (big, small, person):
        await seats.take(s)
    seats.leave(person)
    await seats.take(busy)
    big.under_way, small.under_way = Running(), Running()  # busy is in its steps: not pausable now
    waiting = asyncio.ensure_future(seats.take(seat(PERSON, 4.0)))
    await settle()
    assert small.pause.is_set() and not big.pause.is_set() and not busy.pause.is_set()
    seats.leave(small)
    await settle()
    assert waiting.done()


async def test_one_pause_per_interactive_request_that_waits() -> None:
    seats = Seats(2)
    seats.preempt = True
    a, b = seat(AGENT, 0.0, 10), seat(AGENT, 1.0, 20)
    for s in (a, b):
        await seats.take(s)
        s.under_way = Running()
    one = asyncio.ensure_future(seats.take(seat(PERSON, 2.0)))
    await settle()
    assert a.pause.is_set() and not b.pause.is_set()
    two = asyncio.ensure_future(seats.take(seat(PERSON, 3.0)))
    await settle()
    assert b.pause.is_set()
    seats.leave(a)
    seats.leave(b)
    await asyncio.gather(one, two)


async def test_nothing_is_paused_past_max_pauses_without_preemption_or_mid_tool_call() -> None:
    seats = Seats(1)
    seats.preempt, seats.max_pauses = True, 2
    holder = seat(AGENT, 0.0)
    await seats.take(holder)
    running = Running()
    holder.under_way, holder.use.pauses = running, 2
    waiting = asyncio.ensure_future(seats.take(seat(PERSON, 1.0)))
    await settle()
    assert not holder.pause.is_set()  # paused twice already: it runs to its end
    holder.use.pauses = 0
    running.plain = False  # its answer began a tool call: no prefix goes on from it
    seats.changed()
    assert not holder.pause.is_set()
    running.plain = True
    seats.preempt = False
    seats.changed()
    assert not holder.pause.is_set()
    seats.preempt = True
    seats.changed()
    assert holder.pause.is_set()
    seats.leave(holder)
    await waiting


async def test_an_interactive_seat_is_never_paused_and_a_free_seat_pauses_nothing() -> None:
    seats = Seats(2)
    seats.preempt = True
    person, agent = seat(PERSON, 0.0), seat(AGENT, 1.0)
    await seats.take(person)
    person.under_way = Running()
    await seats.take(seat(PERSON, 2.0))  # the second seat was free
    agent_task = asyncio.ensure_future(seats.take(agent))
    newcomer = asyncio.ensure_future(seats.take(seat(PERSON, 3.0)))
    await settle()
    assert not person.pause.is_set()
    for task in (agent_task, newcomer):
        task.cancel()


async def test_more_slots_let_waiters_in() -> None:
    seats = Seats(1)
    await seats.take(seat(AGENT, 0.0))
    waiting = asyncio.ensure_future(seats.take(seat(AGENT, 1.0)))
    await settle()
    assert not waiting.done()
    seats.resize(2)
    await settle()
    assert waiting.done() and seats.status()["slots"] == 2


def test_why_a_running_seat_is_not_paused() -> None:
    seats = Seats(1)
    seats.preempt = True
    agent = seat(AGENT, 0.0)
    assert seats.why_not_paused(agent) == BETWEEN  # in its steps: asked once under way
    agent.under_way = Running()
    assert seats.why_not_paused(agent) is None
    agent.under_way = Running(plain=False)
    assert seats.why_not_paused(agent) == BEGUN
    agent.under_way, agent.use.pauses = Running(), 3
    assert seats.why_not_paused(agent).code == "max_pauses"  # type: ignore[union-attr]
    agent.use.pauses, agent.unpausable = 0, Why("tools", "its request offers tools")
    assert seats.why_not_paused(agent) == agent.unpausable
    assert seats.why_not_paused(seat(PERSON, 1.0)) == INTERACTIVE
    seats.preempt = False
    assert seats.why_not_paused(seat(AGENT, 2.0)) is seats.preempt_off


async def test_a_person_who_waits_is_told_what_runs_and_why_it_is_not_paused() -> None:
    seats = Seats(1)
    seats.preempt = True
    agent = seat(AGENT, 0.0)
    await seats.take(agent)
    agent.under_way, agent.unpausable = Running(), Why("tools", "its request offers tools")
    before = promtext_value("tools")
    with capture_logs() as logs:
        person = seat(PERSON, 1.0)
        waiting = asyncio.ensure_future(seats.take(person))
        await settle()
        seats.changed()  # looked at again: told once
        await settle()
    told = [e for e in logs if e["event"] == "priority.not_paused"]
    assert len(told) == 1 and told[0]["behind"][0]["reason"] == "tools"
    assert seats.status()["waiting"][0]["behind"][0]["why"] == "its request offers tools"
    assert seats.status()["running"][0]["not_paused"] == "tools" and not agent.pause.is_set()
    assert promtext_value("tools") == before + 1
    seats.leave(agent)
    await waiting
    assert person.behind == []


def promtext_value(reason: str) -> float:
    return METRICS.registry.get_sample_value("llama_wrapper_priority_not_paused_total", {"reason": reason}) or 0.0


async def test_the_lane_is_kept_for_interactive_requests() -> None:
    seats = Seats(2)
    seats.lane = 1
    first, second = seat(AGENT, 0.0), seat(AGENT, 1.0)
    await seats.take(first)
    waiting = asyncio.ensure_future(seats.take(second))
    await settle()
    assert not waiting.done()  # a background request never takes the lane
    person = seat(PERSON, 2.0)
    await asyncio.wait_for(seats.take(person), 1)  # at once, beside the agent: nothing paused
    assert not first.pause.is_set() and seats.status()["lane"]["slots"] == 1
    seats.leave(first)
    await asyncio.wait_for(waiting, 1)  # one background request at a time, beside the person
    another = asyncio.ensure_future(seats.take(seat(AGENT, 3.0)))
    seats.leave(person)
    await settle()
    assert not another.done()  # the person's seat freed is the lane: still not an agent's
    seats.leave(second)
    await asyncio.wait_for(another, 1)


async def test_without_a_lane_interactive_requests_still_go_first() -> None:
    seats = Seats(1)
    agent = seat(AGENT, 0.0)
    await seats.take(agent)
    later_agent, person = seat(AGENT, 1.0), seat(PERSON, 2.0)
    agent_waits = asyncio.ensure_future(seats.take(later_agent))
    person_waits = asyncio.ensure_future(seats.take(person))
    await settle()
    seats.leave(agent)
    await asyncio.wait_for(person_waits, 1)
    assert not agent_waits.done()
    seats.leave(person)
    await asyncio.wait_for(agent_waits, 1)
