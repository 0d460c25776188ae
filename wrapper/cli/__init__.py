"""The command line: `llama-wrapper` and its commands (run, check, reload, the built-ins'), and the log's setup."""
