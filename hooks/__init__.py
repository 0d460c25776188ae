"""Built-in hooks: slot persistence (save/restore, the slot-file format, KV conversion) and `server.reload`.

hooks/registry.py declares each built-in; the wrapper reads it through wrapper/extensions.py only.
"""

DEGRADE = "degrade"  # the degradation built-in's family (hooks/degrade), named here for the built-ins it asks
