"""The wrapper's exit statuses, in one place (docs/commands.md's table). A child that died on its own passes its own
status through (128 + signal when a signal ended it)."""

from __future__ import annotations

EXIT_OK = 0  # a stop we were asked for
EXIT_FAILED = 1  # a command that could not do what it was asked (plan: no rung fits; slots: no such file)
EXIT_CONFIG = 2  # a configuration or command-line error, before anything is spawned
EXIT_START_FAILED = 3  # the start failed: llama-server never became ready, or a start hook failed
