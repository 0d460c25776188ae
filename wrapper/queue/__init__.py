"""Where a request waits: the gate (what the wrapper's state lets through) and the seats (one per slot, interactive
requests first), with the two classes of requests."""
