"""The slot built-ins: `slots.save` and `slots.restore` (actions), the slot book (what each slot holds), the
transfer between a slot and the store, the store of each slot folder, the argv they need (fit), the `slots:`
section, `llama-wrapper slots`. The other built-ins see them through this face only: what each slot holds
(read-only), what an answer leaves in its slot, and the tokens this host's slots held at its last stop."""

from hooks.slots.book import SlotsView, left_in_slot, view_of
from hooks.slots.stores import noted_tokens

__all__ = ["SlotsView", "left_in_slot", "noted_tokens", "view_of"]
