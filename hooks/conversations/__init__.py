"""The conversation cache: every conversation comes back, not only the last one of each slot.

Before each completion request (hooks/conversations/step.py) the wrapper learns the request's tokens, chooses
its slot and pins it there; what leaves that slot is kept in the store first (hooks/conversations/moves.py, the one
place that takes a slot's contents away), and the cached conversation sharing the longest prefix with the request is
restored there when that pays (hooks/conversations/policy.py: the rule, with the rates of
hooks/conversations/rates.py). Requests the server places itself: hooks/conversations/placed.py. Each decision is
logged with both predictions (`conversations.decision`); hooks/conversations/report.py says what it holds.
"""

from __future__ import annotations

from hooks.conversations.checkpoints import keep_while_idle
from hooks.conversations.placed import unpinned
from hooks.conversations.report import metrics, observer, status
from hooks.conversations.room import server_line
from hooks.conversations.settings import CACHE
from hooks.conversations.state import FAMILY
from hooks.conversations.step import PATHS, before
from hooks.slots.settings import FAMILY as SLOTS_FAMILY
from wrapper.configuration.config import Config

__all__ = ["FAMILY", "PATHS", "before", "in_use", "keep_while_idle", "metrics", "observer", "server_line", "status",
           "unpinned"]


def in_use(config: Config) -> bool:
    """With the slot built-ins (they make the slot folder), unless `cache.enabled: false`."""
    return config.uses(SLOTS_FAMILY) and CACHE.of(config).enabled
