"""The pool's last rung, with real processes standing for members: who is asked to sleep (idle long enough for its
sleep.when_asked, longest idle first, for its whole share), and what a sleeper's answer leaves in the folder."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from hooks.degrade.pool.folder import Member, Pool
from hooks.degrade.pool.member import _serve_once, fell_asleep, place_sleep_asks
from tests.unit.degrade.pool.test_pool import GiB, made, sleepers, write_member
from wrapper.configuration.config import parse_config
from wrapper.server.generation import Host


def member(pid: int, share: int, idle_s: float | None, when_asked: float = 60.0, **more: object) -> Member:
    idle_since = time.time() - idle_s if idle_s is not None else 0.0
    return Member(pid, f"m{pid}", share, floor=share // 2, serving=True, idle_since=idle_since,
                  sleeps_when_asked=when_asked, busy=idle_s is None, **more)  # type: ignore[arg-type]


def test_the_longest_idle_members_are_asked_to_sleep_for_their_whole_share(tmp_path: Path) -> None:
    made(tmp_path)
    me = Member(os.getpid(), "me", GiB, serving=True)
    with sleepers(6) as others:
        pids = [p.pid for p in others]
        for record in (member(pids[0], 2 * GiB, idle_s=120),   # idle, but less long than the next
                       member(pids[1], 1 * GiB, idle_s=600),   # the longest idle: asked first
                       member(pids[2], 3 * GiB, idle_s=None),  # busy
                       member(pids[3], 3 * GiB, idle_s=30),    # not idle for its when_asked yet
                       member(pids[4], 3 * GiB, idle_s=900, when_asked=0.0),  # never asked to sleep
                       member(pids[5], 0, idle_s=900, asleep=True)):  # asleep already
            write_member(tmp_path, record)
        with Pool(tmp_path).locked() as held:
            held.put(me)
            placed = place_sleep_asks(held, me, short=int(2.5 * GiB))
            expected = [(pids[1], GiB, "sleep"), (pids[0], 2 * GiB, "sleep")]
            assert [(a.giver, a.bytes, a.kind) for a in placed] == expected
            assert held.member(me.pid).asking  # type: ignore[union-attr]
            assert place_sleep_asks(held, me, short=GiB, exclude=frozenset(pids[:2])) == []


def test_a_sleeper_gives_its_share_to_those_that_asked_and_holds_none_while_asleep(tmp_path: Path) -> None:
    made(tmp_path, total=8 * GiB)
    with sleepers(2) as askers:
        first, second = (p.pid for p in askers)
        pool = Pool(tmp_path)
        with pool.locked() as held:
            held.put(Member(os.getpid(), "sleeper", 3 * GiB, floor=GiB, serving=True))
            held.put(Member(first, "first", GiB))
            held.put(Member(second, "second", GiB))
            me = held.member(os.getpid())
            assert me is not None
            asks = [held.ask(held.member(first), me, 2 * GiB, kind="sleep"),  # type: ignore[arg-type]
                    held.ask(held.member(second), me, 3 * GiB, kind="sleep")]  # type: ignore[arg-type]
        fell_asleep(pool, asks, 3 * GiB)
        with pool.locked() as held:
            answers = {a.asker: a for a in held.asks()}
            assert (answers[first].state, answers[first].given) == ("given", 2 * GiB)
            assert (answers[second].state, answers[second].given) == ("given", GiB)  # what was left of it
            shares = {m.pid: m for m in held.members()}
            assert shares[first].share == 3 * GiB and shares[second].share == 2 * GiB
            sleeper = shares[os.getpid()]
            assert (sleeper.share, sleeper.asleep, sleeper.serving) == (0, True, False)
            assert held.free() == 8 * GiB - 5 * GiB  # nothing counted twice


class _Host:
    """What the pool's serving loop asks of the wrapper: requests in flight now, and how long none has been asked."""

    def __init__(self, in_flight: int, idle_s: float) -> None:
        self.in_flight, self._idle_s = in_flight, idle_s
        self.current = SimpleNamespace(config=parse_config("", "<test>"))

    def idle_s(self) -> float:
        return self._idle_s


async def test_a_member_whose_requests_are_all_shorter_than_a_poll_is_not_idle_since_its_start(
        tmp_path: Path) -> None:
    """The loop samples `in_flight` every POLL_S: a request that came and went between two samples was never seen,
    and the member looked idle since its start (an idle member is asked to sleep first). Its idleness is the
    wrapper's own count (the gate's: exact), so the record says when it was last asked."""
    made(tmp_path)
    pool = Pool(tmp_path)
    with pool.locked() as held:
        held.put(Member(os.getpid(), "me", GiB, serving=True, idle_since=time.time() - 600))
    host = cast(Host, _Host(in_flight=0, idle_s=0.05))  # a short request ended 50 ms ago, between two samples
    await _serve_once(host, pool, lambda host, asked: None, lambda: False, False)
    with pool.locked() as held:
        me = held.member(os.getpid())
        assert me is not None and not me.busy and time.time() - me.idle_since < 5, me
