"""What the built-in hooks may use of the running wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wrapper.child import Child
from wrapper.config import Config
from wrapper.launch import Launch
from wrapper.llama import LlamaClient

if TYPE_CHECKING:
    from hooks.reuse import ReuseTracker


@dataclass
class Runtime:
    config: Config
    launch: Launch
    client: LlamaClient
    child: Child | None = None
    restore_report: list[dict[str, Any]] = field(default_factory=list)
    save_report: list[dict[str, Any]] = field(default_factory=list)
    reuse: ReuseTracker | None = None
