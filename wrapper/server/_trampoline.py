"""Exec trampoline: ties a program's life to the wrapper's, then runs it.

Run as `python -I -S _trampoline.py PARENT_PID MODE ARGV...`. PR_SET_PDEATHSIG must be set in the child itself,
and Python's `preexec_fn` is unsafe once asyncio has threads, so a tiny separate interpreter does it.
- MODE `exec` (llama-server): the kernel SIGKILLs the program if the wrapper dies; the trampoline becomes it.
- MODE `guard:FD` (hook commands): the trampoline stays as the program's parent, a subreaper that adopts
  whatever the program leaves running (detached with setsid or not). When the program ends it writes its
  status to FD (the hook is over), then stays until all it adopted has ended. On SIGUSR1 — the wrapper asks,
  or the wrapper died (the death signal) — it SIGKILLs all of them and its process group, itself included.
The death signal survives exec but not fork. This file imports nothing from the wrapper on purpose.
"""

import contextlib
import ctypes
import glob
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(option, value, 0, 0, 0) != 0:
            sys.stderr.write(f"llama-wrapper: prctl({option}) failed: errno {ctypes.get_errno()}\n")
            os._exit(126)


def arm(parent: int, sig: int) -> None:
    prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:  # the wrapper died before the death signal was armed
        os._exit(1)


def become(argv: list[str]) -> None:
    # This interpreter ignored SIGPIPE and SIGXFSZ at start-up; an ignored signal survives exec, so undo it.
    for name in ("SIGPIPE", "SIGXFSZ", "SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"llama-wrapper: cannot run {argv[0]!r}: {exc.strerror}\n")
        os._exit(127)


def take_all_down(*_: object) -> None:
    """SIGKILL every process this guard adopted or started, then its whole process group (itself too)."""
    for listing in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError, ValueError), open(listing) as children:
            for pid in children.read().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
    os.killpg(0, signal.SIGKILL)


def guard(argv: list[str], status_fd: int) -> None:
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    child = os.fork()
    if child == 0:
        os.close(status_fd)
        become(argv)
    # The stop signals reach the whole group; the program decides how to end, and we report how it did.
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)
    with contextlib.suppress(OSError):
        os.write(status_fd, str(code).encode())
    os.close(status_fd)
    while True:  # what the program left running is ours now: stay while it runs, so it can still be ended
        try:
            os.wait()
        except ChildProcessError:
            break
    os._exit(0)


def main() -> None:
    parent, mode, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if mode.startswith("guard:"):
        signal.signal(signal.SIGUSR1, take_all_down)
        arm(parent, signal.SIGUSR1)
        guard(argv, int(mode.partition(":")[2]))
    else:
        arm(parent, signal.SIGKILL)
        become(argv)


if __name__ == "__main__":
    main()
