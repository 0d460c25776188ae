"""Exec trampoline: makes the kernel kill the program if the wrapper dies, then becomes the program.

Run as `python -I -S _trampoline.py PARENT_PID ARGV...`. PR_SET_PDEATHSIG must be set in the child itself,
and Python's `preexec_fn` is unsafe once asyncio has threads, so a tiny separate interpreter does it and
execs. The death signal survives exec. This file imports nothing from the wrapper on purpose.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            sys.stderr.write(f"llama-wrapper: prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}\n")
            os._exit(126)
        if os.getppid() != parent:  # the wrapper died before the death signal was armed
            os._exit(1)
    # This interpreter ignored SIGPIPE and SIGXFSZ at start-up; an ignored signal survives exec, so undo it.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"llama-wrapper: cannot run {argv[0]!r}: {exc.strerror}\n")
        os._exit(127)


if __name__ == "__main__":
    main()
