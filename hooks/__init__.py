"""Built-in hooks: slot persistence (save/restore) and the slot-file format.

The names below are what a config's `builtin:` may say; the wrapper looks the implementations up lazily so
that reading a config never imports the heavier modules.
"""

from __future__ import annotations

SLOT_BUILTINS = ("slots.save", "slots.restore")
BUILTIN_NAMES = SLOT_BUILTINS
