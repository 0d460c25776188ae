"""The built-in server.reload."""
