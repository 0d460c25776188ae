"""What the wrapper is told: the config file and its sections (the wrapper's own and how they are declared), the
hooks' templates, llama-server's argv and the edits a reload asks of it, API keys and the admin token, the
command line's shape and the exit statuses."""
