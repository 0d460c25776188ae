"""The gate's hand-over: a reload cuts only the resumable exchanges, and tells them from a cut at a deadline."""

from __future__ import annotations

import asyncio

from wrapper.lifecycle import State
from wrapper.queue.gate import Admission, Gate


async def _admitted(gate: Gate, resumable: bool | None) -> asyncio.Future[None]:
    """`resumable`: None, not one the loop goes on from; else whether it can go on at this moment."""
    assert await gate.enter() is Admission.ADMITTED
    exchange: asyncio.Future[None] = asyncio.ensure_future(asyncio.sleep(60))
    gate.track(exchange, None if resumable is None else (lambda: resumable))
    return exchange


async def test_a_hand_over_cuts_the_resumable_exchanges_only() -> None:
    gate = Gate()
    gate.follow(State.READY)
    stream, whole, reasoning = await _admitted(gate, True), await _admitted(gate, None), await _admitted(gate, False)
    assert gate.carry_streams() == 1
    await asyncio.wait([stream], timeout=1)
    assert stream.cancelled() and gate.handed_over(stream)
    assert not whole.done() and not gate.handed_over(whole)
    assert not reasoning.done()  # its answer so far is not plain text: it is waited for
    reasoning.cancel()
    gate.leave(reasoning)
    gate.leave(stream)
    assert not gate.handed_over(stream) and gate.in_flight == 1  # forgotten once it left
    assert gate.carry_streams() == 0  # the JSON answer is waited for
    whole.cancel()
    gate.leave(whole)
    assert await gate.drained(0.1)


async def test_a_cut_at_the_deadline_is_not_a_hand_over() -> None:
    gate = Gate()
    gate.follow(State.READY)
    stream = await _admitted(gate, True)
    assert gate.cut() == 1
    await asyncio.wait([stream], timeout=1)
    assert stream.cancelled() and not gate.handed_over(stream)
    gate.leave(stream)
