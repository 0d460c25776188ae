"""Exec trampoline: ties a program's life to the wrapper's, then runs it.

Run as `python -I -S _trampoline.py PARENT_PID MODE ARGV...`. PR_SET_PDEATHSIG must be set in the child itself,
and Python's `preexec_fn` is unsafe once asyncio has threads, so a tiny separate interpreter does it.
- MODE `exec` (llama-server): the kernel SIGKILLs the program if the wrapper dies; the trampoline becomes it.
- MODE `guard` (hook commands): the trampoline stays as the program's parent and leader of its process group;
  if the wrapper dies it SIGKILLs the whole group, so no background job of a hook outlives the wrapper.
  It ends as the program ends, with the same status.
The death signal survives exec but not fork. This file imports nothing from the wrapper on purpose.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def arm(parent: int, sig: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            sys.stderr.write(f"llama-wrapper: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}\n")
            os._exit(126)
        if os.getppid() != parent:  # the wrapper died before the death signal was armed
            os._exit(1)


def become(argv: list[str]) -> None:
    # This interpreter ignored SIGPIPE and SIGXFSZ at start-up; an ignored signal survives exec, so undo it.
    for name in ("SIGPIPE", "SIGXFSZ", "SIGTERM", "SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"llama-wrapper: cannot run {argv[0]!r}: {exc.strerror}\n")
        os._exit(127)


def guard(argv: list[str]) -> None:
    child = os.fork()
    if child == 0:
        become(argv)
    # The stop signals reach the whole group; the program decides how to end, and we end with it.
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main() -> None:
    parent, mode, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if mode == "guard":
        signal.signal(signal.SIGUSR1, lambda *_: os.killpg(0, signal.SIGKILL))  # the wrapper died: all of us go
        arm(parent, signal.SIGUSR1)
        guard(argv)
    else:
        arm(parent, signal.SIGKILL)
        become(argv)


if __name__ == "__main__":
    main()
