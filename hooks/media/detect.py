"""Does a request carry media? One walk of its JSON body, for every API llama-server takes media on: OpenAI
chat content parts (`image_url`, `input_audio`, `input_video`, `video_url`), Responses items (`input_image`,
`input_audio`, `input_file`... with an image), Anthropic `image` blocks, and `/completion`'s
`multimodal_data`. A pure function: a unit table keeps it honest."""

from __future__ import annotations

from typing import Any

PART_TYPES = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio",
              "audio": "audio", "input_video": "video", "video_url": "video"}
MAX_DEPTH = 8  # messages → content → part: a body nested deeper than this is not a chat request


def media_in(payload: Any, depth: int = 0) -> str | None:
    """The first kind of media the body carries (`image`, `audio`, `video`), None when it carries none."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(payload, dict):
        kind = payload.get("type")
        if isinstance(kind, str) and kind in PART_TYPES and _has_content(payload, kind):
            return PART_TYPES[kind]
        data = payload.get("multimodal_data")
        if isinstance(data, list) and data:
            return "image"
        for value in payload.values():
            if isinstance(value, dict | list) and (found := media_in(value, depth + 1)) is not None:
                return found
    elif isinstance(payload, list):
        for item in payload:
            if isinstance(item, dict | list) and (found := media_in(item, depth + 1)) is not None:
                return found
    return None


def _has_content(part: dict[str, Any], kind: str) -> bool:
    """Whether a part of that type is media: Anthropic's `image` only with its `source` (a bare `{"type":
    "image"}` in some other field is not an image); the others whatever they hold (an empty one still needs
    the projector to be answered at all)."""
    return "source" in part if kind == "image" else True
