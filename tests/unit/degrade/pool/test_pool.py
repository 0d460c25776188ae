"""The pool folder (hooks/degrade/pool/folder.py) and the asking round on it (hooks/degrade/pool/member.py), with real
processes: members whose pid is gone, a zombie, a reused pid, processes reserving at once, one SIGKILLed while
it writes; and the asks: who is asked for what, the answers, what a finished round leaves."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from hooks.degrade.pool.folder import (
    FORMAT,
    MOVES_KEPT,
    VERSION,
    Locked,
    Member,
    Pool,
    PoolError,
    Request,
    alive,
    process_start,
)
from hooks.degrade.pool.member import Asking, collect, finish, place_asks
from wrapper.configuration.config import ConfigError
from wrapper.configuration.units import format_size

ROOT = Path(__file__).resolve().parents[4]
GiB = 1 << 30


def python(code: str, *args: str) -> subprocess.Popen[str]:
    """A child `python -c CODE ARGS...` in the project's root, stdout piped."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return ""


def exited_pid() -> int:
    """The pid of a process that ran and was reaped."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@contextlib.contextmanager
def sleepers(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`n` living processes to stand for other members."""
    found = [subprocess.Popen(["sleep", "30"]) for _ in range(n)]
    try:
        yield found
    finally:
        for p in found:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def write_member(pool: Path, member: Member) -> Path:
    """A record as a member writes it, bypassing `put` (which would fill `started` from /proc)."""
    path = pool / "members" / f"{member.pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(member)))
    return path


def made(pool: Path, total: int = 8 * GiB, device: str = "CUDA0") -> None:
    with Pool(pool).locked() as held:
        held.join(total, "degrade.budget", device, explicit=True)


# -- joining ----------------------------------------------------------------------------------------------------


def test_the_first_member_makes_the_pool_and_the_others_must_agree(tmp_path: Path) -> None:
    pool = Pool(tmp_path / "pool")
    with pool.locked() as held:
        assert held.made() is None
        assert held.total == 0
        first = held.join(8 * GiB, "degrade.budget", "CUDA0", explicit=True)
    on_disk = json.loads((tmp_path / "pool" / "pool.json").read_text())
    assert on_disk == first
    assert (on_disk["format"], on_disk["version"], on_disk["total"], on_disk["device"]) == (
        FORMAT, VERSION, 8 * GiB, "CUDA0")

    with pool.locked() as held:
        assert held.total == 8 * GiB
        assert held.join(8 * GiB, "degrade.budget", "CUDA0", explicit=True)["total"] == 8 * GiB
        # `auto`: takes the pool's total whatever it measured itself
        assert held.join(3 * GiB, "measured", "CUDA0", explicit=False)["total"] == 8 * GiB
        with pytest.raises(PoolError) as disagree:
            held.join(4 * GiB, "degrade.budget", "CUDA0", explicit=True)
        with pytest.raises(PoolError) as device:
            held.join(8 * GiB, "degrade.budget", "host", explicit=False)
    message = str(disagree.value)
    assert format_size(8 * GiB) in message and format_size(4 * GiB) in message
    assert "same budget" in message and "remove the folder" in message
    assert "CUDA0" in str(device.value) and "host" in str(device.value)
    assert isinstance(disagree.value, ConfigError)
    # nothing a refused member asked for changed the pool
    assert json.loads((tmp_path / "pool" / "pool.json").read_text()) == on_disk


@pytest.mark.parametrize("found", [{"format": FORMAT, "version": VERSION + 1, "total": 1},
                                   {"format": "something else", "version": VERSION, "total": 1}])
def test_a_pool_of_another_version_says_to_remove_the_folder(tmp_path: Path, found: dict[str, object]) -> None:
    (tmp_path / "pool.json").write_text(json.dumps(found))
    with Pool(tmp_path).locked() as held, pytest.raises(PoolError, match="remove the folder"):
        held.join(1, "degrade.budget", "CUDA0", explicit=False)
    with Pool(tmp_path).locked() as held, pytest.raises(PoolError, match=str(VERSION)):
        held.made()


def test_a_folder_that_cannot_be_made_is_a_pool_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(PoolError, match="cannot use the folder"), Pool(tmp_path / "file" / "pool").locked():
        pass


# -- dead members -----------------------------------------------------------------------------------------------


def test_members_gone_a_zombie_and_a_reused_pid_are_dead_and_their_share_is_free(tmp_path: Path) -> None:
    made(tmp_path, total=1000)
    exited = exited_pid()
    zombie = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(zombie.pid, signal.SIGKILL)
        for _ in range(500):
            if state(zombie.pid) == "Z":
                break
            time.sleep(0.01)
        assert state(zombie.pid) == "Z"
        assert not alive(zombie.pid, process_start(zombie.pid))
        me, mine = os.getpid(), process_start(os.getpid())
        assert alive(me, mine) and alive(me, "") and not alive(me, mine + "1") and not alive(exited, "")

        with sleepers(1) as (reused,):
            # a record of `reused`'s pid written by an earlier process of that pid
            records = {exited: write_member(tmp_path, Member(exited, "exited", share=100)),
                       zombie.pid: write_member(tmp_path, Member(zombie.pid, "zombie", share=200)),
                       reused.pid: write_member(tmp_path, Member(reused.pid, "reused", share=300,
                                                                 started=str(int(process_start(reused.pid)) - 7)))}
            write_member(tmp_path, Member(me, "me", share=50, started=mine))
            with Pool(tmp_path).locked() as held:
                asks = [held.ask(Member(me, "me", 0), Member(pid, "x", 0), 10) for pid in records]
                asks.append(held.ask(Member(exited, "exited", 0), Member(me, "me", 0), 10))
                kept = held.ask(Member(me, "me", 0), Member(os.getppid(), "parent", 0), 10)
                assert len(held.asks()) == 5

                living = held.members()
                assert [m.pid for m in living] == [me]
                assert sorted(m.pid for m in held.gone) == sorted(records)
                assert {m.model for m in held.gone} == {"exited", "zombie", "reused"}
                assert all(not path.exists() for path in records.values())
                assert [a.id for a in held.asks()] == [kept.id]  # only asks naming a living pid stay
                assert all(not (tmp_path / "asks" / f"{a.id}.json").exists() for a in asks)
                assert held.free() == 1000 - 50
                assert held.free(me) == 1000
            with Pool(tmp_path).locked() as held:
                assert held.gone == [] and [m.pid for m in held.members()] == [me]
    finally:
        zombie.wait()


def test_dead_members_share_is_free_without_anyone_removing_it_first(tmp_path: Path) -> None:
    made(tmp_path, total=1000)
    write_member(tmp_path, Member(exited_pid(), "gone", share=900))
    with Pool(tmp_path).locked() as held:
        assert held.free(os.getpid()) == 1000
        assert held.used_by_others(os.getpid()) == 0
        assert [m.model for m in held.gone] == ["gone"]


def test_unreadable_records_are_removed_and_temporary_files_ignored(tmp_path: Path) -> None:
    made(tmp_path)
    members = tmp_path / "members"
    members.mkdir(exist_ok=True)
    (members / "1.json").write_text('{"pid": 1, "mod')  # cut short: never written whole by a member
    (members / "2.json").write_text("[1, 2]")
    (members / "3.json").write_text('{"pid": 3}')  # no model, no share
    temporary = members / ".4.json.4.tmp"  # what a member killed while writing leaves
    temporary.write_text('{"pid": 4, "model"')
    with Pool(tmp_path).locked() as held:
        held.put(Member(os.getpid(), "me", share=5))
        assert [m.pid for m in held.members()] == [os.getpid()]
    assert sorted(p.name for p in members.iterdir()) == sorted([f"{os.getpid()}.json", temporary.name])


def test_put_records_the_start_time_and_leave_drops_the_record_and_its_asks(tmp_path: Path) -> None:
    made(tmp_path)
    me = os.getpid()
    with Pool(tmp_path).locked() as held:
        held.put(Member(me, "me", share=7, floor=2))
        record = held.member(me)
        assert record is not None and record.started == process_start(me) != ""
        assert record.spare() == 5 and record.name == f"me[{me}]"
        mine = held.ask(record, Member(os.getppid(), "p", 0), 1)
        theirs = held.ask(Member(os.getppid(), "p", 0), record, 1)
        held.leave(me)
        assert held.member(me) is None
        assert [a.id for a in held.asks()] == [theirs.id] != [mine.id]


# -- processes at once ------------------------------------------------------------------------------------------

RESERVE = """
    import os, random, sys
    from pathlib import Path
    from hooks.degrade.pool.folder import Member, Pool
    pool, rounds = Pool(Path(sys.argv[1])), int(sys.argv[2])
    me, rng, worst = os.getpid(), random.Random(os.getpid()), 0
    for i in range(rounds):
        with Pool(pool.dir).locked() as held:
            take = min(held.free(me), rng.randrange(0, 700))
            held.put(Member(me, "m", share=take))
            worst = max(worst, sum(m.share for m in held.members()) - held.total)
        with Pool(pool.dir).locked() as held:
            held.put(Member(me, "m", share=rng.randrange(0, take + 1)))  # gives some back
            worst = max(worst, sum(m.share for m in held.members()) - held.total)
    with pool.locked() as held:
        held.leave(me)
    print(worst)
    sys.exit(1 if worst > 0 else 0)
"""


def test_processes_reserving_at_once_never_take_more_than_the_total(tmp_path: Path) -> None:
    total = 1000
    made(tmp_path, total=total)
    children = [python(RESERVE, str(tmp_path), "150") for _ in range(4)]
    seen: list[int] = []
    try:
        while any(c.poll() is None for c in children):
            with Pool(tmp_path).locked() as held:
                seen.append(sum(m.share for m in held.members()))
    finally:
        outs = [c.communicate(timeout=30) for c in children]
    for child, (out, err) in zip(children, outs, strict=True):
        assert child.returncode == 0, (out, err)
        assert int(out.strip()) <= 0
    assert seen and max(seen) <= total
    assert max(seen) > 0  # they did take shares while the test watched
    with Pool(tmp_path).locked() as held:
        assert held.members() == []  # all left
        assert held.free() == total


# -- a member killed while writing ------------------------------------------------------------------------------

WRITER = """
    import os, sys
    from pathlib import Path
    from hooks.degrade.pool.folder import Member, Pool
    pool, me, i = Pool(Path(sys.argv[1])), os.getpid(), 0
    while True:
        with pool.locked() as held:
            held.put(Member(me, "m" * (i % 5000), share=i))
            other = Member(int(sys.argv[2]), "x", 0)
            held.drop_ask(held.ask(Member(me, "m", 0), other, i).id)
            held.moved({"i": i, "pad": "p" * (i % 3000)})
            if i == 0:
                print("ready", flush=True)
        i += 1
"""


def test_a_member_killed_while_writing_leaves_the_pool_readable(tmp_path: Path) -> None:
    made(tmp_path)
    for delay in (0.05, 0.11, 0.17):
        writer = python(WRITER, str(tmp_path), str(os.getpid()))
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(writer.pid, signal.SIGKILL)
        writer.communicate()
        assert writer.returncode == -signal.SIGKILL

        fd = os.open(tmp_path / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel released the dead holder's lock
        finally:
            os.close(fd)
        for path in (tmp_path / "members").glob("*.json"):
            json.loads(path.read_text())  # written whole or not at all
        with Pool(tmp_path).locked() as held:
            assert held.members() == []
            assert [m.pid for m in held.gone] == [writer.pid]
            assert held.asks() == []  # its asks are all dropped (or went with it)
            assert all("i" in m for m in held.moves(MOVES_KEPT))
            assert held.total == 8 * GiB
            held.put(Member(os.getpid(), "next", share=1))  # the pool takes a new member
            assert [m.model for m in held.members()] == ["next"]
            held.leave(os.getpid())
        assert not (tmp_path / "members" / f"{writer.pid}.json").exists()
        assert all(p.name.endswith(".tmp") for p in (tmp_path / "members").iterdir())


# -- asking -----------------------------------------------------------------------------------------------------


def givers(pool: Path, pids: list[int]) -> dict[str, Member]:
    """Members for the living `pids`: what each can spare above its floor."""
    a, b, c, d, e, f = pids
    found = {"idle100": Member(a, "idle100", share=400, floor=300, serving=True),
             "busy500": Member(b, "busy500", share=900, floor=400, busy=True, serving=True),
             "idle300": Member(c, "idle300", share=500, floor=200, serving=True),
             "asking": Member(d, "asking", share=5000, floor=0, asking=True, serving=True),
             "none": Member(e, "none", share=300, floor=300, serving=True),
             "busy50": Member(f, "busy50", share=150, floor=100, busy=True, serving=True)}
    with Pool(pool).locked() as held:
        for member in found.values():
            held.put(member)
    return found


def names(held: Locked, asks: list[Request]) -> list[tuple[str, int]]:
    by_pid = {m.pid: m.model for m in held.members()}
    return [(by_pid[a.giver], a.bytes) for a in asks]


@pytest.mark.parametrize(("short", "asked"), [
    (350, [("idle300", 300), ("idle100", 50)]),
    (300, [("idle300", 300)]),
    (600, [("idle300", 300), ("idle100", 100), ("busy500", 200)]),
    (10**9, [("idle300", 300), ("idle100", 100), ("busy500", 500), ("busy50", 50)]),
])
def test_place_asks_idle_first_then_most_spare_each_for_no_more_than_it_spares(
        tmp_path: Path, short: int, asked: list[tuple[str, int]]) -> None:
    made(tmp_path)
    with sleepers(6) as procs:
        givers(tmp_path, [p.pid for p in procs])
        me = Member(os.getpid(), "me", share=100)
        with Pool(tmp_path).locked() as held:
            placed = place_asks(held, me, short)
            assert names(held, placed) == asked
            assert sum(a.bytes for a in placed) == min(short, 300 + 100 + 500 + 50)
            assert all(a.asker == me.pid and a.asker_model == "me" and a.state == "asked" for a in placed)
            assert sorted(a.id for a in held.asks()) == sorted(a.id for a in placed)
            record = held.member(me.pid)
            assert me.asking and record is not None and record.asking


def test_place_asks_with_nobody_to_spare_asks_nothing_and_is_not_asking(tmp_path: Path) -> None:
    made(tmp_path)
    with sleepers(1) as (other,), Pool(tmp_path).locked() as held:
        held.put(Member(other.pid, "full", share=300, floor=300, serving=True))
        me = Member(os.getpid(), "me", share=100, floor=0)
        assert place_asks(held, me, 100) == []
        record = held.member(me.pid)
        assert record is not None and not record.asking and held.asks() == []


def test_collect_waits_for_every_answer_and_a_gone_giver_refuses(tmp_path: Path) -> None:
    made(tmp_path)
    with sleepers(3) as procs:
        pids = [p.pid for p in procs]
        pool = Pool(tmp_path)
        with pool.locked() as held:
            for pid in pids:
                held.put(Member(pid, f"g{pid}", share=1000, floor=0, serving=True))
            me = Member(os.getpid(), "me", share=10)
            began = time.monotonic()
            placed = place_asks(held, me, 2500)
            assert [a.bytes for a in placed] == [1000, 1000, 500]
            assert collect(held, placed) is None

        first, second, third = placed
        with pool.locked() as held:
            first.state, first.given, first.reason, first.took_s = "given", 1000, "its draft", 0.5
            held.write_ask(first)
            assert collect(held, placed) is None  # two still asked
            second.state, second.reason = "refused", "it is growing itself"
            held.write_ask(second)
            assert collect(held, placed) is None  # the third still asked

        gone = next(p for p in procs if p.pid == third.giver)
        gone.kill()
        gone.wait()
        with pool.locked() as held:
            answers = collect(held, placed)
            assert answers is not None
            assert [(a.id, a.state, a.given) for a in answers] == [
                (first.id, "given", 1000), (second.id, "refused", 0), (third.id, "refused", 0)]
            assert answers[2].reason == "the member is gone"

            done = finish(held, me, placed, answers, began)
            assert (done.asked, done.given) == (2500, 1000)
            assert held.asks() == []
            record = held.member(me.pid)
            assert record is not None and not record.asking and not me.asking
            moves = held.moves()
            assert len(moves) == 1
            move = moves[0]
            assert (move["asker"], move["asked"], move["given"]) == (me.name, 2500, 1000)
            assert [(g["pid"], g["asked"], g["given"], g["state"]) for g in move["givers"]] == [
                (first.giver, 1000, 1000, "given"), (second.giver, 1000, 0, "refused"),
                (third.giver, 500, 0, "refused")]
            assert move["givers"][0]["what"] == "its draft" and move["givers"][0]["took_s"] == 0.5


def test_collect_counts_an_ask_file_removed_as_refused(tmp_path: Path) -> None:
    made(tmp_path)
    with sleepers(1) as (giver,), Pool(tmp_path).locked() as held:
        held.put(Member(giver.pid, "g", share=100, serving=True))
        placed = place_asks(held, Member(os.getpid(), "me", 0), 50)
        held.drop_ask(placed[0].id)
        answers = collect(held, placed)
        assert answers is not None and [a.state for a in answers] == ["refused"]


def test_asking_a_round_that_finds_nobody_finishes_at_once_and_moves_nothing(tmp_path: Path) -> None:
    made(tmp_path)
    me = Member(os.getpid(), "me", share=10)
    asking = Asking(Pool(tmp_path), me, 100, wait=60)
    assert asking.placed == []
    done = asking.poll()
    assert done is not None and (done.asked, done.given, done.answers) == (0, 0, [])
    with Pool(tmp_path).locked() as held:
        assert held.moves() == []
        record = held.member(me.pid)
        assert record is not None and not record.asking


def test_asking_answered_by_another_process_and_one_past_its_wait(tmp_path: Path) -> None:
    made(tmp_path)
    answerer = """
        import sys, time
        from pathlib import Path
        from hooks.degrade.pool.folder import Pool
        pool = Pool(Path(sys.argv[1]))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with pool.locked() as held:
                mine = [a for a in held.asks() if a.state == "asked"]
                for a in mine:
                    a.state, a.given, a.reason = "given", a.bytes // 2, "half"
                    held.write_ask(a)
            if mine:
                break
            time.sleep(0.02)
    """
    with sleepers(2) as (slow, quick):
        with Pool(tmp_path).locked() as held:
            held.put(Member(quick.pid, "quick", share=400, serving=True))
        me = Member(os.getpid(), "me", share=10)
        asking = Asking(Pool(tmp_path), me, 300, wait=60)
        assert [(a.giver, a.bytes) for a in asking.placed] == [(quick.pid, 300)]
        child = python(answerer, str(tmp_path))
        done = None
        for _ in range(1000):
            if (done := asking.poll()) is not None:
                break
            time.sleep(0.01)
        child.communicate(timeout=20)
        assert done is not None and done.given == 150 and [a.reason for a in done.answers] == ["half"]

        with Pool(tmp_path).locked() as held:
            held.put(Member(slow.pid, "slow", share=400, serving=True))
            held.leave(quick.pid)
        late = Asking(Pool(tmp_path), me, 100, wait=0)
        time.sleep(0.01)
        done = late.poll()
        assert done is not None and done.given == 0
        assert [(a.state, a.reason) for a in done.answers] == [("refused", "no answer within degrade.pool_wait")]
        with Pool(tmp_path).locked() as held:
            assert held.asks() == []
            assert [m["given"] for m in held.moves()] == [150, 0]


# -- moves ------------------------------------------------------------------------------------------------------


def test_moves_keeps_the_last_ones(tmp_path: Path) -> None:
    made(tmp_path)
    with Pool(tmp_path).locked() as held:
        assert held.moves() == []
        for i in range(MOVES_KEPT + 30):
            held.moved({"i": i})
        lines = (tmp_path / "moves.jsonl").read_text().splitlines()
        assert len(lines) == MOVES_KEPT
        assert [json.loads(line)["i"] for line in lines] == list(range(30, MOVES_KEPT + 30))
        assert [m["i"] for m in held.moves()] == list(range(MOVES_KEPT + 10, MOVES_KEPT + 30))
        assert [m["i"] for m in held.moves(5)] == list(range(MOVES_KEPT + 25, MOVES_KEPT + 30))
        assert held.moves(0) == []
    assert not list(tmp_path.glob(".moves.*.tmp"))


def process_started_s() -> float:
    """When this process started (its elapsed time from ps: the source /proc does not share with the wrapper)."""
    elapsed = subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True, text=True,
                             check=True).stdout
    return time.time() - int(elapsed)


def test_summary_reports_the_living_members_and_what_is_free(tmp_path: Path) -> None:
    made(tmp_path, total=1000)
    write_member(tmp_path, Member(exited_pid(), "gone", share=500))
    with Pool(tmp_path).locked() as held:
        held.put(Member(os.getpid(), "me", share=300))
        held.moved({"i": 1})
        found = held.summary()
    assert (found["total"], found["used"], found["free"], found["device"]) == (1000, 300, 700, "CUDA0")
    assert [m["name"] for m in found["members"]] == [f"me[{os.getpid()}]"]
    assert found["moves"] == [{"i": 1}]
    started = datetime.datetime.strptime(found["members"][0]["started"], "%Y-%m-%dT%H:%M:%S%z")  # a time, not ticks
    assert abs(started.timestamp() - process_started_s()) < 5


# -- known bugs -------------------------------------------------------------------------------------------------


def test_asking_past_its_wait_keeps_the_answers_already_in(tmp_path: Path) -> None:
    made(tmp_path)
    with sleepers(2) as procs:
        with Pool(tmp_path).locked() as held:
            for p in procs:
                held.put(Member(p.pid, f"g{p.pid}", share=1000, serving=True))
        asking = Asking(Pool(tmp_path), Member(os.getpid(), "me", share=10), 1500, wait=0)
        answered = asking.placed[0]
        with Pool(tmp_path).locked() as held:
            answered.state, answered.given, answered.reason = "given", 1000, "its draft"
            held.write_ask(answered)
        time.sleep(0.01)
        done = asking.poll()
        assert done is not None
        assert [a.state for a in done.answers] == ["given", "refused"]
        assert done.given == 1000


@pytest.mark.parametrize("pid", ["5", 0])
def test_a_record_with_a_pid_that_is_no_process_is_removed(tmp_path: Path, pid: object) -> None:
    made(tmp_path, total=1000)
    (tmp_path / "members").mkdir(exist_ok=True)
    (tmp_path / "members" / "5.json").write_text(json.dumps({"pid": pid, "model": "x", "share": 600}))
    with Pool(tmp_path).locked() as held:
        assert held.members() == []
        assert held.free() == 1000


def test_a_member_still_starting_is_not_asked(tmp_path: Path) -> None:
    made(tmp_path)
    with sleepers(2) as procs, Pool(tmp_path).locked() as held:
        held.put(Member(procs[0].pid, "starting", share=5000))  # no serving: its answers would not come yet
        held.put(Member(procs[1].pid, "ready", share=400, serving=True))
        placed = place_asks(held, Member(os.getpid(), "me", 0), 1000)
        assert [(a.giver, a.bytes) for a in placed] == [(procs[1].pid, 400)]
        again = place_asks(held, Member(os.getpid(), "me", 0), 1000, exclude=frozenset({procs[1].pid}))
        assert again == []  # asked already: not asked twice in one wait


@pytest.mark.parametrize("text", ["garbage", "", '{"format": "llama-wrapper pool", "total": 6291',
                                  '{"format": "llama-wrapper pool", "version": 1}',
                                  '{"format": "llama-wrapper pool", "version": 1, "total": "lots", "device": "CPU"}'])
def test_a_damaged_pool_file_is_never_written_over(tmp_path: Path, text: str) -> None:
    (tmp_path / "pool.json").write_text(text)
    with pytest.raises(PoolError, match=r"pool\.json is damaged.*remove the folder"), Pool(tmp_path).locked() as held:
        held.join(700 << 20, "degrade.budget", "CPU", explicit=True)
    assert (tmp_path / "pool.json").read_text() == text


def test_a_member_is_named_by_its_alias_else_by_its_model() -> None:
    """Two wrappers of one model in a pool (the demo's main and task) are told apart by llama-server's --alias."""
    from hooks.degrade.pool.member import member_name
    from wrapper.configuration.config import Listen
    from wrapper.launching.launch import Launch
    from wrapper.launching.model import Model

    def launch(*more: str) -> Launch:
        return Launch(argv=["llama-server", "-m", "m.gguf", *more], port=1, listen=Listen("127.0.0.1", 8080),
                      model=Model(path="m.gguf", name="SmolLM2", id="x"), env={}, notes=[], facts={})

    assert member_name(launch()) == "SmolLM2"
    assert member_name(launch("--alias", "task")) == "task"
    assert member_name(launch("-a", "main,chat")) == "main"  # the first of its aliases
    assert member_name(launch("-a", "")) == "SmolLM2"
