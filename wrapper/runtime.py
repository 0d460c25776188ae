"""What the built-in hooks may use of the running wrapper: one generation's config, launch, client and child."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wrapper.child import Child
from wrapper.config import Config
from wrapper.launch import Launch
from wrapper.llama import LlamaClient


@dataclass
class Runtime:
    config: Config
    launch: Launch
    client: LlamaClient
    child: Child | None = None
    state: dict[str, Any] = field(default_factory=dict)  # each built-in's own, under its family name
