"""llama-server's slot-state file: the format and its conversion between cache types and versions."""
