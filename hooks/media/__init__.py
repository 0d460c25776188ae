"""The projector on demand (`media:`): llama-server starts without the user's `--mmproj`, clients are still
told the model sees images, and the first request that carries media is held while the wrapper reloads with
the projector; after `media.idle` without one it is dropped again. Without any projector a media request is
the wrapper's 400 instead of llama-server's 500.

settings (the section), detect (does a request carry media: a pure function), state (what is kept), fit (the
argv), step (before a request), report (status, metrics, what /props and /v1/models say), idle (dropping it).
"""

from __future__ import annotations

FAMILY = "media"
