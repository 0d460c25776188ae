#!/bin/sh
# on_stopped hook: tell someone when llama-server did not stop cleanly.
#   on_stopped:
#     - exec: [examples/hooks/notify-stopped.sh]
#       ignore_errors: true
# Uses only the LLAMA_* variables the wrapper sets for shell and exec actions.
set -eu
if [ "$LLAMA_WRAPPER_RESULT" = "success" ]; then
  exit 0
fi
message="$LLAMA_MODEL_NAME stopped: $LLAMA_WRAPPER_RESULT (exit code ${LLAMA_WRAPPER_EXIT_CODE:-none}, signal ${LLAMA_WRAPPER_EXIT_SIGNAL:-none})"
if command -v notify-send >/dev/null 2>&1; then
  notify-send "llama-wrapper" "$message"
else
  logger -t llama-wrapper "$message" 2>/dev/null || echo "$message" >&2
fi
