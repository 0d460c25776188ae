"""What a move of degrade's asks the next fit for (hooks/degrade/move.py makes the move, hooks/degrade/fit.py the
fit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hooks.asks import MemoryMove, asking


@dataclass(frozen=True)
class Wanted:
    """What a move asks the next fit for."""

    rung: str | None = None
    budget: tuple[int, str] | None = None  # bytes and where they come from
    backend: str | None = None  # plan for this backend (BACKENDS), not for this build's devices: `plan --backend`
    ctx: int | None = None  # with a pool: the context to take (a member takes what it needs, not all it could)
    limit: int | None = None  # with a pool: take at most these bytes (a member giving some back)
    up: bool = False  # a move up (a relax): nothing is given up for it
    projector: bool = False  # a move up that takes back the projector given up for memory (hooks/media)

    def as_asks(self) -> dict[type[Any], Any]:
        """The next fits' asks: this for degrade's, and for the others a move made for memory."""
        return asking(self, MemoryMove(up=self.up, projector=self.projector))
