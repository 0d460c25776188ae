"""What a llama-server is started with: its command line settled from the config, what the model file, the binary
and the machine say, and what a built-in's command gets to settle one."""
