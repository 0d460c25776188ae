#!/bin/sh
# on_will_stop hook: keep a line per stop with what each slot held (reads llama-server's GET /slots).
#   on_will_stop:
#     - builtin: slots.save
#     - exec: [examples/hooks/record-slots.sh, /var/log/llama-wrapper/slots.log]
set -eu
log=${1:-/dev/stderr}
slots=$(curl -fsS -m 5 "$LLAMA_SERVER_URL/slots")
printf '%s %s %s\n' "$(date -u +%FT%TZ)" "$LLAMA_MODEL_ID" "$slots" >>"$log"
