"""llama-wrapper: a supervising proxy in front of one llama-server."""

from __future__ import annotations

__version__ = "0.1.0"
