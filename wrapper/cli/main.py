"""The command line: `run`, `check`, `reload`, and the built-ins' commands (`slots`, `plan`); every option also
as a LLAMA_WRAPPER_* variable. Each command's module is imported when that command runs (or when help lists
it): `llama-wrapper reload` does not load numpy, gguf or the built-ins."""

from __future__ import annotations

import importlib
from typing import Any

import click

from hooks.commands import BUILTIN_COMMANDS
from wrapper import __version__
from wrapper.configuration.config import Config
from wrapper.configuration.usage import RUN_EXAMPLES
from wrapper.kept import Kept
from wrapper.launching.commands import Commands
from wrapper.launching.launch import Asks, Launch

COMMANDS = {
    "run": "wrapper.cli.run:run",
    "check": "wrapper.cli.run:check",
    "reload": "wrapper.cli.reload:reload",
    **BUILTIN_COMMANDS,
}
EPILOG = RUN_EXAMPLES + """
\b
Saved slots:
  llama-wrapper slots ls
  llama-wrapper slots inspect ~/.cache/llama-wrapper/slots/<model-id>/conv-<key>-<fingerprint>.bin
"""


class _Lazy(click.Group):
    """Subcommands named by `module:attribute`, imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command)
        return command


def _built_ins() -> Any:
    return importlib.import_module("wrapper.built_ins")


def _load(path: str | None) -> Config:
    config: Config = _built_ins().load(path)
    return config


def _launch_for(config: Config, shared: Kept, asks: Asks) -> Launch:
    launch: Launch = _built_ins().launch_for(config, shared, asks)
    return launch


@click.group(cls=_Lazy, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog=EPILOG)
@click.version_option(__version__, prog_name="llama-wrapper")
@click.pass_context
def main(context: click.Context) -> None:
    """A supervising proxy for llama.cpp's llama-server: lifecycle hooks, slot persistence, reloads and
    degradation under a memory budget."""
    context.obj = Commands(load=_load, launch_for=_launch_for)  # a built-in's command loads and prepares as `run` does


if __name__ == "__main__":
    main()
