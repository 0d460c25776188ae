"""The slot built-ins: slots.save and slots.restore, the slot book, the transfer between a slot and the store."""
