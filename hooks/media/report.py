"""What the media built-in tells: its part of /wrapper/status and /metrics, and what clients are told of the
model while the projector is not loaded (/props `modalities`, /v1/models `input_modalities` and
`capabilities`, as llama-server shows them with it), so that a front-end offers its image button."""

from __future__ import annotations

import time
from typing import Any

from hooks.media.settings import MEDIA, on_demand
from hooks.media.state import configured, loaded, state
from wrapper.configuration import argv as args
from wrapper.launching.gguf_meta import GGUFError, read_metadata
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation


def status(generation: Generation) -> dict[str, Any]:
    kept, settings = state(generation), MEDIA.of(generation.config)
    idle = None if kept.last_media_at is None else round(time.monotonic() - kept.last_media_at, 1)
    return {"projector": settings.projector, "configured": configured(generation.config),
            "loaded": loaded(generation), "idle_s": idle, "drop_after_s": settings.idle, "in_flight": kept.in_flight,
            "loads": kept.loads, "drops": kept.drops, "refused": kept.refused, "decisions": list(kept.decisions)}


def metrics(generation: Generation) -> None:
    METRICS.projector_loaded.set(1 if loaded(generation) else 0)


def promised(generation: Generation) -> dict[str, bool] | None:
    """The modalities clients are told while the projector waits to be loaded; None when nothing is promised
    (it is loaded, or not on demand)."""
    config = generation.config
    if not on_demand(config) or not configured(config) or loaded(generation):
        return None
    kept = state(generation)
    if kept.modalities:
        return dict(kept.modalities)  # as the server said when it had the projector
    return _from_file(args.get(config.argv, args.MMPROJ))


def applies(generation: Generation) -> bool:
    """With a projector in the argv every /props is looked at (its modalities learnt, its media marker kept:
    a reload draws another), and with it on demand /props and /v1/models say what it will give."""
    return configured(generation.config)


def _from_file(path: str | None) -> dict[str, bool]:
    """From the projector's own header (clip.has_vision_encoder / clip.has_audio_encoder); vision when it
    cannot be read (a URL, an unreadable file)."""
    vision, audio = True, False
    if path is not None:
        try:
            meta = read_metadata(path)
            vision = bool(meta.get("clip.has_vision_encoder", True))
            audio = bool(meta.get("clip.has_audio_encoder", False))
        except (OSError, GGUFError):
            pass
    return {"vision": vision, "video": vision, "audio": audio}


def learn(generation: Generation, props: dict[str, Any]) -> None:
    """Keep what a server with the projector says it sees, for when it is not loaded."""
    seen = props.get("modalities")
    if loaded(generation) and isinstance(seen, dict):
        state(generation).modalities = {str(k): bool(v) for k, v in seen.items()}


def shown(generation: Generation, path: str, answer: dict[str, Any]) -> dict[str, Any]:
    """/props and /v1/models as they would be with the projector loaded."""
    if path == "/props":
        learn(generation, answer)
        if isinstance(marker := answer.get("media_marker"), str) and marker:
            state(generation).markers.add(marker)
    sees = promised(generation)
    if sees is None:
        return answer
    if path == "/props":
        return {**answer, "modalities": {**(answer.get("modalities") or {}), **sees}}
    inputs = ["text", *(name for name, on in (("image", sees.get("vision")), ("audio", sees.get("audio")),
                                              ("video", sees.get("video"))) if on)]
    data, models = answer.get("data"), answer.get("models")
    if isinstance(data, list):  # OpenAI's list: `architecture.input_modalities`
        answer = {**answer, "data": [_with_inputs(entry, inputs) for entry in data]}
    if isinstance(models, list):  # llama-server's own list: `capabilities`
        answer = {**answer, "models": [_with_capability(entry) for entry in models]}
    return answer


def _with_inputs(entry: Any, inputs: list[str]) -> Any:
    if not isinstance(entry, dict):
        return entry
    found = entry.get("architecture")
    architecture: dict[str, Any] = found if isinstance(found, dict) else {}
    known = list(architecture.get("input_modalities") or ["text"])
    return {**entry, "architecture": {**architecture,
                                      "input_modalities": known + [i for i in inputs if i not in known]}}


def _with_capability(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    capabilities = list(entry.get("capabilities") or [])
    return {**entry, "capabilities": capabilities + ([] if "multimodal" in capabilities else ["multimodal"])}
