#!/bin/sh
# on_startup hook: one tiny completion so the first real request does not pay for cold caches.
#   on_startup:
#     - builtin: slots.restore
#     - exec: [examples/hooks/warm-up.sh]
# Runs after the restore, so it uses a slot the restore left empty (or re-evaluates one token).
set -eu
curl -fsS -m 30 -H 'Content-Type: application/json' \
  -d '{"prompt": "Hello", "n_predict": 1, "cache_prompt": false}' \
  "$LLAMA_SERVER_URL/completion" >/dev/null
echo "warmed up $LLAMA_MODEL_NAME (pid $LLAMA_SERVER_PID)"
