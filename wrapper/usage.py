"""How the wrapper is run, shown by `llama-wrapper --help` and `llama-wrapper run --help`."""

RUN_EXAMPLES = """
\b
Examples:
  llama-wrapper run -- llama-server -m model.gguf -c 8192
  llama-wrapper run --config hooks.yaml --listen 127.0.0.1:8080 -- llama-server -m model.gguf
  llama-wrapper check hooks.yaml
\b
As a llama-swap model:
  cmd: llama-wrapper run --listen 127.0.0.1:${PORT} --config chat.yaml -- llama-server -m chat.gguf
"""
