"""One llama-server: its generation (the process, its client, the built-ins' state for it; what built-ins may ask
of the wrapper), the child process, its HTTP client, the context it runs with and the levels of its output."""
