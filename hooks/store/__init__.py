"""Where saved states are kept: the interface, the slot folder, chunks, the bucket, the two tiers."""
