"""This wrapper as a member of a pool (`degrade.pool`, the folder in hooks/degrade/pool/folder.py): the share its fit
takes, asking the others to give when it needs more than is free, giving when they ask, and its record.

An asker writes one ask per giver, idle members first, each for at most what that member can spare above its
floor, and waits (`degrade.pool_wait`; its client is held) until every giver has answered. A member that is
asking gives nothing meanwhile (two members growing at once each refuse the other: nobody waits on anybody),
and every share is taken under the pool's lock from what is free then, so the shares never add up to more than
the total.

The last rung: when the others' ladders cannot give enough, members idle for at least their `sleep.when_asked` are
asked to sleep (longest idle first), each for its whole share; a sleeper answers once its server has stopped, its
share 0 from then until a wake fits it again as at a start (which may ask another to sleep in turn)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from hooks.degrade.pool.folder import Locked, Member, Pool, Request
from hooks.degrade.settings import DEGRADE, DegradeSettings
from hooks.degrade.state import Fitted, fitted
from wrapper.configuration import argv as args
from wrapper.configuration.sections import SLEEP
from wrapper.configuration.units import format_size
from wrapper.launching.launch import Launch
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation, Host

log = structlog.get_logger()

POLL_S = 0.2


def pool_of(settings: DegradeSettings) -> Pool | None:
    return Pool(settings.pool) if settings.pool is not None else None


_IDLE_SINCE = [time.time()]  # since when this member serves nothing (kept by the serving loop)


def member_name(launch: Launch) -> str:
    """How the pool names this member: llama-server's first `--alias` when given (two wrappers of one model told
    apart), else its model's name."""
    alias = args.get(launch.argv, args.ALIAS)
    first = alias.split(",")[0].strip() if alias else ""
    return first or launch.model.name


def record(generation: Generation, fit: Fitted, busy: bool = False, asking: bool = False) -> Member:
    """This member's record from a generation that serves."""
    return Member(os.getpid(), member_name(generation.launch), fit.share, fit.floor, busy, fit.rung, fit.n_ctx, asking,
                  serving=True, idle_since=0.0 if busy else _IDLE_SINCE[0],
                  sleeps_when_asked=SLEEP.of(generation.config).when_asked or 0.0)


@dataclass
class Asked:
    """What an asker got: per giver, the bytes and what it gave up."""

    asked: int
    answers: list[Request] = field(default_factory=list)
    took_s: float = 0.0

    @property
    def given(self) -> int:
        return sum(a.given for a in self.answers)


def place_asks(held: Locked, me: Member, short: int, exclude: frozenset[int] = frozenset()) -> list[Request]:
    """Request the others for `short` bytes: idle members before busy ones, the one with most to spare first, each for
    no more than it can spare; only members that answer asks, and none of `exclude` (asked already)."""
    others = sorted((m for m in held.members() if m.pid != me.pid and m.pid not in exclude and m.serving
                     and not m.asking and m.spare() > 0), key=lambda m: (m.busy, -m.spare()))
    placed, left = [], short
    for giver in others:
        if left <= 0:
            break
        amount = min(giver.spare(), left)
        placed.append(held.ask(me, giver, amount))
        left -= amount
    _mark(held, me, asking=bool(placed))
    return placed


def place_sleep_asks(held: Locked, me: Member, short: int, exclude: frozenset[int] = frozenset()) -> list[Request]:
    """The last rung: ask members idle for at least their sleep.when_asked to sleep, longest idle first, each for
    its whole share, until `short` is covered (none of `exclude`)."""
    now = time.time()
    sleepers = sorted((m for m in held.members() if m.pid != me.pid and m.pid not in exclude and m.may_sleep(now)),
                      key=lambda m: m.idle_since)
    placed, left = [], short
    for sleeper in sleepers:
        if left <= 0:
            break
        placed.append(held.ask(me, sleeper, sleeper.share, kind="sleep"))
        left -= sleeper.share
    _mark(held, me, asking=bool(placed))
    return placed


def _mark(held: Locked, me: Member, asking: bool) -> None:
    """Say in the asker's record whether it is asking, keeping the share it has there (what givers added)."""
    current = held.member(me.pid) or me
    current.asking = me.asking = asking
    me.share = current.share
    held.put(current)


def collect(held: Locked, placed: list[Request], late: bool = False) -> list[Request] | None:
    """The answers once every giver answered (a dead giver answers nothing), else None; `late` (the wait is
    over): the answers in, and the others refused."""
    found = {a.id: a for a in held.asks()}
    living = {m.pid for m in held.members()}
    answers = []
    for ask in placed:
        now = found.get(ask.id)
        if now is None or ask.giver not in living:
            answers.append(_refused(ask, "the member is gone"))
        elif now.state == "asked":
            if not late:
                return None
            answers.append(_refused(ask, "no answer within degrade.pool_wait"))
        else:
            answers.append(now)
    return answers


def _refused(ask: Request, why: str) -> Request:
    return Request(ask.id, ask.asker, ask.asker_model, ask.giver, ask.bytes, ask.at, "refused", reason=why,
                   kind=ask.kind)


def finish(held: Locked, me: Member, placed: list[Request], answers: list[Request], began: float) -> Asked:
    for ask in placed:
        held.drop_ask(ask.id)
    done = Asked(sum(a.bytes for a in placed), answers, round(time.monotonic() - began, 3))
    _mark(held, me, asking=False)
    if placed:
        move = {"at": time.time(), "asker": me.name, "asked": done.asked, "given": done.given, "took_s": done.took_s,
                "givers": [{"pid": a.giver, "asked": a.bytes, "given": a.given, "state": a.state,
                            "what": a.reason, "took_s": a.took_s} for a in answers]}
        held.moved(move)
        METRICS.pool_moves.labels(role="asked").inc()
        log.info("pool.asked", **move)
    return done


class Asking:
    """One round of asking: placed at once, answered when every giver has (or at `degrade.pool_wait`)."""

    def __init__(self, pool: Pool, me: Member, short: int, wait: float, exclude: frozenset[int] = frozenset(),
                 sleep: bool = False) -> None:
        self.pool, self.me = pool, me
        self.began = time.monotonic()
        self.deadline = self.began + wait
        with pool.locked() as held:
            self.placed = (place_sleep_asks if sleep else place_asks)(held, me, short, exclude)
        nobody = ("no other member has been idle for its sleep.when_asked" if sleep else
                  "no other member has anything to spare above its floor")
        log.info("pool.ask", asker=me.name, short=short, kind="sleep" if sleep else "give",
                 asks=[{"giver": a.giver, "bytes": a.bytes} for a in self.placed],
                 message=None if self.placed else nobody)

    def poll(self) -> Asked | None:
        """What was given, once every answer is in; None while some are awaited."""
        with self.pool.locked() as held:
            answers = collect(held, self.placed, late=time.monotonic() > self.deadline) if self.placed else []
            return finish(held, self.me, self.placed, answers, self.began) if answers is not None else None


def ask_now(pool: Pool, me: Member, short: int, wait: float) -> Asked:
    """At a start or a wake (nothing served, the loop not asked meanwhile): ask and wait for the answers here; what
    the ladders could not give is asked of the idle members as sleep, within the same wait."""
    deadline = time.monotonic() + wait
    got = Asked(short)
    for sleep in (False, True):
        asking = Asking(pool, me, short - got.given, deadline - time.monotonic(), _asked_of(got, sleep), sleep)
        while (done := asking.poll()) is None:
            time.sleep(POLL_S)
        got.answers += done.answers
        if got.given >= short or time.monotonic() >= deadline:
            break
    return got


async def ask(pool: Pool, me: Member, short: int, wait: float) -> Asked:
    """Request the others for `short` bytes and wait (without blocking the loop) for their answers; what the first
    ones asked could not give is asked of the others, within the same wait."""
    began, deadline = time.monotonic(), time.monotonic() + wait
    got = Asked(short)
    sleep = False  # the ladders first; what they cannot give, of the members idle long enough to sleep
    while True:
        done = await _round(Asking(pool, me, short - got.given, deadline - time.monotonic(), _asked_of(got, sleep),
                                   sleep))
        got.answers += done.answers
        if got.given >= short or time.monotonic() >= deadline or (sleep and not done.answers):
            got.took_s = round(time.monotonic() - began, 3)
            return got
        sleep = sleep or not done.answers


def _asked_of(got: Asked, sleep: bool) -> frozenset[int]:
    """The members asked already in this way (one that could give nothing above its floor may still sleep)."""
    return frozenset(a.giver for a in got.answers if (a.kind == "sleep") == sleep)


async def _round(asking: Asking) -> Asked:
    try:
        while True:  # the answers come from other processes, through the folder: nothing here to wait on but time
            done = asking.poll()
            if done is not None:
                return done
            await asyncio.sleep(POLL_S)
    except asyncio.CancelledError:  # the client hung up: the asks are taken back, the member asks no more
        with asking.pool.locked() as held:
            finish(held, asking.me, asking.placed, [], asking.began)
        raise


def publish(generation: Generation, busy: bool) -> None:
    """Write this member's record from the generation that runs (after a move that failed, too)."""
    fit = fitted(generation.launch)
    pool = pool_of_generation(generation)
    if fit is None or pool is None:
        return
    with pool.locked() as held:
        held.put(record(generation, fit, busy))


def pool_of_generation(generation: Generation) -> Pool | None:
    settings = DEGRADE.on(generation.config)
    return pool_of(settings) if settings is not None else None


async def serve_asks(host: Host, give: Callable[[Host, Request], Any], growing: Callable[[], bool]) -> None:
    """In the background while the server runs: keep the record's `busy` true to what runs, and answer the asks
    made of this member (`give` moves and says what it gave). Leaves the pool at the stop."""
    pool = pool_of_generation(host.current)
    if pool is None:
        return
    atexit.register(_leave, pool)  # after the server has stopped: its memory is free only then
    busy: bool | None = None
    while True:
        await asyncio.sleep(POLL_S)
        try:
            busy = await _serve_once(host, pool, give, growing, busy)
        except Exception:  # a bug or a folder error must not end the answers (nor the relax) for the wrapper's life
            log.exception("pool.serve_failed")


async def _serve_once(host: Host, pool: Pool, give: Callable[[Host, Request], Any], growing: Callable[[], bool],
                      busy: bool | None) -> bool | None:
    now_busy = host.in_flight > 0
    if not now_busy:  # the wrapper's own count (exact): a request shorter than a poll counts too
        _IDLE_SINCE[0] = time.time() - host.idle_s()
    with pool.locked() as held:
        mine = [a for a in held.asks() if a.giver == os.getpid() and a.state == "asked"]
        me = held.member(os.getpid())
        if me is not None and (now_busy != busy or not me.serving or (
                not now_busy and abs(me.idle_since - _IDLE_SINCE[0]) > POLL_S)):
            me.busy, me.serving, busy = now_busy, True, now_busy
            me.idle_since = 0.0 if now_busy else _IDLE_SINCE[0]
            me.sleeps_when_asked = SLEEP.of(host.current.config).when_asked or 0.0
            held.put(me)
        for gone in held.gone:
            log.info("pool.member_gone", member=gone.name, share=gone.share,
                     message=f"its {format_size(gone.share)} are free again")
    for asked in mine:
        if growing() or (me is not None and me.asking):
            await answer(pool, asked, "refused", 0, "it is growing itself", 0.0)
            continue
        try:
            await give(host, asked)
        except Exception as exc:
            await answer(pool, asked, "refused", 0, f"it failed: {exc}", 0.0)
            raise
    return busy


def fell_asleep(pool: Pool, asks: list[Request], share: int) -> None:
    """This member's server stopped to sleep: its share goes to those that asked it to sleep (as much as each
    asked), the rest is free; its record says asleep, with no share, answering no asks until it wakes."""
    left = share
    with pool.locked() as held:
        me = held.member(os.getpid())
        waiting = {a.id for a in held.asks()}
        for asked in asks:
            if asked.id not in waiting:
                continue  # the asker stopped waiting
            given = min(asked.bytes, left)
            left -= given
            asked.state, asked.given = "given" if given else "refused", given
            asked.took_s = round(time.time() - asked.at, 3)  # from the ask to the server stopped
            asked.reason = "fell asleep" if given else "fell asleep: its share went to another asker"
            held.write_ask(asked)
            asker = held.member(asked.asker)
            if given and asker is not None:
                asker.share += given
                held.put(asker)
        if me is not None:
            me.share, me.floor, me.asleep, me.serving, me.busy, me.asking = 0, 0, True, False, False, False
            held.put(me)
    for asked in asks:
        log.info("pool.gave", asker=f"{asked.asker_model}[{asked.asker}]", asked=asked.bytes, given=asked.given,
                 what=asked.reason, took_s=asked.took_s)
        if asked.given:
            METRICS.pool_moves.labels(role="gave").inc()


def _leave(pool: Pool) -> None:
    with contextlib.suppress(OSError), pool.locked() as held:
        held.leave(os.getpid())
    log.info("pool.left", dir=str(pool.dir))


async def answer(pool: Pool, asked: Request, state: str, given: int, what: str, took_s: float) -> None:
    with pool.locked() as held:
        if not any(a.id == asked.id for a in held.asks()):
            return  # the asker stopped waiting (or is gone)
        asked.state, asked.given, asked.reason, asked.took_s = state, given, what, took_s
        held.write_ask(asked)
        asker = held.member(asked.asker)
        if given and asker is not None:  # the asker's until its fit takes it: nobody else, this giver included,
            asker.share += given  # can take it in the meantime (the giver's own climb back among them)
            held.put(asker)
    if given:
        METRICS.pool_moves.labels(role="gave").inc()
    log.info("pool.gave" if state == "given" else "pool.refused", asker=f"{asked.asker_model}[{asked.asker}]",
             asked=asked.bytes, given=given, what=what, took_s=took_s)

