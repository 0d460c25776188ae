"""Built-in hooks: slot persistence (save/restore, the slot-file format, KV conversion) and `server.reload`.

hooks/registry.py declares each built-in; the wrapper reads it through wrapper/extensions.py only.
"""
