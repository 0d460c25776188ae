"""The built-ins' `llama-wrapper` subcommands, named by where they live: the command line imports only the one
that runs (the built-ins' modules load numpy and gguf)."""

from __future__ import annotations

BUILTIN_COMMANDS = {
    "slots": "hooks.slots.cli:slots",  # list, inspect and remove saved slot files
    "plan": "hooks.degrade.plan_cli:plan",  # the memory plan and the degradation ladder, no server started
}
