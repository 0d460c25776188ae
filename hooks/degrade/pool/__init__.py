"""A memory pool shared by the wrappers of one device: the folder, a member, its moves."""
