"""llama-server's slot-state file: the format (format.py, the one walker of it, re-exported here) and its
conversion between cache types and state versions (convert.py)."""

from hooks.kvfile.format import (
    MAGIC,
    READS,
    ROT_WRITTEN,
    Buffer,
    Header,
    KvLayout,
    Layer,
    Section,
    SlotFile,
    SlotFileError,
    Stream,
    header,
    open_map,
    read,
    version,
    walk,
)

__all__ = ["MAGIC", "READS", "ROT_WRITTEN", "Buffer", "Header", "KvLayout", "Layer", "Section", "SlotFile",
           "SlotFileError", "Stream", "header", "open_map", "read", "version", "walk"]
