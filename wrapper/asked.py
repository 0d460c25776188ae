"""Who asks, and how: one record per request, made once as it arrives (wrapper/answers/forwarding.py) and carried
wherever it goes — its seat in the slots' queue, its passes, the built-ins' steps (wrapper/steps.py's Outgoing) —
so that each reads the same answer, and the log says it once (`request.classed`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from wrapper.configuration.consumers import is_salted, name_of


class Class(Enum):
    """Whose request it is, for the queue (wrapper/queue/priority.py tells it from the request's marks)."""

    INTERACTIVE = "interactive"  # a person's
    BACKGROUND = "background"  # an agent's, a batch's


@dataclass(frozen=True)
class Asked:
    path: str
    consumer: str | None = None  # whose conversations it reads and leaves (`consumers:`, a front-end's user), with
    # its `cache_salt`'s digest when it sets one; None: nobody named
    klass: Class = Class.INTERACTIVE
    by: str = ""  # the mark that decided its class, in words
    session: str | None = None  # the session an agent says it belongs to (X-Session-Id, prompt_cache_key, ...)

    @property
    def background(self) -> bool:
        return self.klass is Class.BACKGROUND

    @property
    def name(self) -> str | None:
        """The consumer it is counted as (its `cache_salt` left out): the status, /metrics, the shares."""
        return name_of(self.consumer) if self.consumer is not None else None

    @property
    def salted(self) -> bool:
        return is_salted(self.consumer)

    def said(self) -> dict[str, Any]:
        """What the log says of it (never the salt)."""
        return {"path": self.path, "consumer": self.name, "salted": self.salted, "class": self.klass.value,
                "by": self.by, **({"session": self.session} if self.session is not None else {})}
