"""A supervised subprocess: own session, dies with the wrapper, one SIGTERM, always reaped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAMPOLINE = str(Path(__file__).with_name("_trampoline.py"))
OUTPUT_LIMIT = 1 << 20  # longest line kept whole; longer ones are split
PIPE_GRACE = 0.5  # after an exit, how long the rest of the output may take to arrive
GUARD_GRACE = 1.0  # how long a guard gets to take its program's leftovers down before its group is killed
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time, per second


@dataclass(frozen=True)
class Exit:
    """How a process ended."""

    returncode: int
    killed: bool = False  # we had to SIGKILL it after the stop timeout
    asked: bool = False  # we had sent it the SIGTERM: it did not die on its own

    @property
    def code(self) -> int | None:
        return self.returncode if self.returncode >= 0 else None

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None

    @property
    def signal_name(self) -> str | None:
        number = self.signal
        if number is None:
            return None
        with contextlib.suppress(ValueError):
            return signal.Signals(number).name
        return str(number)

    @property
    def status(self) -> int:
        """A shell-style exit status: the code, or 128 + the signal."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    @property
    def crashed(self) -> bool:
        """It ended in a way nobody asked for: by a signal other than our SIGTERM or our SIGKILL after the stop
        timeout (a SIGSEGV, a SIGABRT, the kernel's OOM kill), or with a non-zero code before any SIGTERM."""
        if self.returncode == 0:
            return False
        if self.signal is None:
            return not self.asked
        ours = (self.asked and self.signal == signal.SIGTERM) or (self.killed and self.signal == signal.SIGKILL)
        return not ours

    @property
    def log_level(self) -> int:
        """How loud its `child.exited` is: error for a crash, warning for a kill after the stop timeout."""
        if self.crashed:
            return logging.ERROR
        return logging.WARNING if self.killed else logging.INFO


async def spawn(
    argv: Sequence[str], env: Mapping[str, str] | None, on_line: Callable[[str], None], guard: bool = False
) -> Child:
    """Start `argv` in its own session, its life tied to ours, its output fed to `on_line`.

    Without `guard` the kernel kills the program if we die. With it (hook commands) a guard process stays as
    the program's parent: it reports the program's end on a pipe of its own, then stays while anything the
    program left running does (it adopts them), and takes all of them down when we die or ask it to.
    """
    loop = asyncio.get_running_loop()
    status_read, status_write = os.pipe() if guard else (-1, -1)
    mode = f"guard:{status_write}" if guard else "exec"
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(OUTPUT_LIMIT, loop),
            sys.executable, "-I", "-S", TRAMPOLINE, str(os.getpid()), mode, *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env=dict(env) if env is not None else None,
            pass_fds=(status_write,) if guard else (),
        )
    except BaseException:
        if guard:
            os.close(status_read)
        raise
    finally:
        if guard:
            os.close(status_write)
    reported = _reported_status(loop, status_read) if guard else None
    return Child(asyncio.subprocess.Process(transport, protocol, loop), protocol, on_line, reported)


def _reported_status(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.Future[int | None]:
    """The status a guard writes when its program ends; None if the guard died without a word."""
    reported: asyncio.Future[int | None] = loop.create_future()
    received = bytearray()
    os.set_blocking(fd, False)

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 64)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if chunk:
            received.extend(chunk)
            return
        loop.remove_reader(fd)
        os.close(fd)
        if not reported.done():
            text = received.decode().strip()
            reported.set_result(int(text) if text.lstrip("-").isdigit() else None)

    loop.add_reader(fd, on_readable)
    return reported


def exited(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie not yet reaped (its state in /proc/PID/stat is Z or X);
    False without /proc (not Linux)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # the name may hold ") "
    except FileNotFoundError:
        return Path("/proc/self").exists()
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def cpu_seconds(pid: int) -> float | None:
    """The CPU time process `pid` has used, user and system, all its threads together (utime + stime of
    /proc/PID/stat, in steps of 1/CLOCK_TICKS s); None without /proc (not Linux) or without that process."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold ") "
        return (int(after_name[11]) + int(after_name[12])) / CLOCK_TICKS  # fields 14 and 15
    except (OSError, IndexError, ValueError):
        return None


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Learns of the exit when the process ends, not when its output pipe closes: a background job a hook
    left behind may hold the pipe open for as long as it likes."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited: asyncio.Future[int] = loop.create_future()
        self._subprocess: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert isinstance(transport, asyncio.SubprocessTransport)
        self._subprocess = transport

    def close_pipes(self) -> None:
        if self._subprocess is not None:
            self._subprocess.close()

    def process_exited(self) -> None:
        code = self._subprocess.get_returncode() if self._subprocess is not None else None
        super().process_exited()
        if not self.exited.done() and code is not None:
            self.exited.set_result(code)


LEAVING = "cleaning up before exit"  # llama-server's line once a signal began its exit: its loop is ending, and
# what is asked of it meanwhile is never answered (a SIGTERM to the wrapper and to it together: the stop's save
# waited for its hook's timeout)


class Child:
    """A running child: its output drained line by line, its exit awaited once, stopped with one SIGTERM."""

    def __init__(self, process: asyncio.subprocess.Process, protocol: _Protocol,
                 on_line: Callable[[str], None], reported: asyncio.Future[int | None] | None = None) -> None:
        self._process = process
        self._protocol = protocol
        self._reported = reported  # a guarded program: its end comes from the guard, which may stay longer
        self._on_line = on_line
        self._sigterm_sent = False
        self.tail: deque[str] = deque(maxlen=200)
        self.lines_seen = 0
        self._pump = asyncio.ensure_future(self._drain())
        self._exit: asyncio.Future[Exit] = asyncio.ensure_future(self._reap())
        self._closer = asyncio.ensure_future(self._close_when_gone())
        self._killed = False
        self.leaving = asyncio.Event()  # it said it is exiting by itself (LEAVING): it answers nothing more

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._exit.done()

    def exited_now(self) -> bool:
        """Whether the process has ended, as the kernel says now (a zombie, or gone), before the wrapper's loop has
        reaped it: a busy machine may run that late."""
        return self.alive and exited(self.pid)

    def cpu_time(self) -> float | None:
        """The CPU seconds it has used so far (cpu_seconds); None once it ended, or where that is not known."""
        return cpu_seconds(self.pid) if self.alive else None

    @property
    def lingering(self) -> bool:
        """The program ended, but what it left running has not (its guard is still there)."""
        return not self.alive and not self._protocol.exited.done()

    def lines_since(self, mark: int) -> list[str]:
        """Output lines after `lines_seen` was `mark` (as many as the tail still holds)."""
        wanted = self.lines_seen - mark
        return list(self.tail)[-wanted:] if wanted > 0 else []

    async def wait(self) -> Exit:
        return await asyncio.shield(self._exit)

    async def stop(self, timeout: float) -> Exit:
        """One SIGTERM to the child's process group; SIGKILL after `timeout`; reaped before returning."""
        if self.alive and not self._sigterm_sent:
            self._sigterm_sent = True
            self._signal_group(signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.shield(self._exit), timeout)
        except TimeoutError:
            self.kill()
            return await asyncio.shield(self._exit)

    def kill(self) -> None:
        if self.alive:
            self._killed = True
        self.end_leftovers()

    def end_leftovers(self) -> None:
        """SIGKILL the program and all it left running; a guard first takes down what it adopted."""
        if self._protocol.exited.done():
            return  # nothing is left: a guard stays until all it adopted has ended
        if self._reported is None:
            self._signal_group(signal.SIGKILL)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self._process.pid, signal.SIGUSR1)
        asyncio.get_running_loop().call_later(GUARD_GRACE, self._backstop)

    def _backstop(self) -> None:
        if not self._protocol.exited.done():  # the guard did not manage: the group at least
            self._signal_group(signal.SIGKILL)

    async def gone(self) -> None:
        """Wait until the process itself (for a guarded program: its guard) has exited."""
        await asyncio.shield(self._protocol.exited)

    def _signal_group(self, sig: signal.Signals) -> None:
        # The child leads its own session, so its group id is its pid; the group also covers its children.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, sig)

    async def _reap(self) -> Exit:
        if self._reported is not None:  # (not first_of: it would cancel the one that is not done)
            either: list[asyncio.Future[Any]] = [self._reported, self._protocol.exited]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        reported = self._reported.result() if self._reported is not None and self._reported.done() else None
        returncode = reported if reported is not None else await self._protocol.exited
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._pump), PIPE_GRACE)
        return Exit(returncode, killed=self._killed, asked=self._sigterm_sent)

    async def _close_when_gone(self) -> None:
        """Read the output for as long as the process (or what a hook left running) writes it, then close."""
        await self._protocol.exited
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._pump), PIPE_GRACE)
        if not self._pump.done():  # a detached job holds the pipe: stop reading it
            self._pump.cancel()
        self._protocol.close_pipes()

    async def _drain(self) -> None:
        stream = self._process.stdout
        assert stream is not None
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line longer than the limit: take what is buffered as one piece
                raw = await stream.read(OUTPUT_LIMIT)
            if not raw:
                return
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.lines_seen += 1
            self.tail.append(line)
            if LEAVING in line:
                self.leaving.set()
            self._on_line(line)
