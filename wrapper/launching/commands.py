"""What a built-in's `llama-wrapper` subcommand gets from the command group (click's context object): the
config loaded and the launch prepared exactly as `run` does them, with every built-in's sections and argv
changes, without the built-in importing the registry that lists it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from wrapper.configuration.config import Config
from wrapper.kept import Kept
from wrapper.launching.launch import Asks, Launch


@dataclass(frozen=True)
class Commands:
    load: Callable[[str | None], Config]  # a config file (None: every default); ConfigError names each problem
    launch_for: Callable[[Config, Kept, Asks], Launch]  # config, shared state, asks
