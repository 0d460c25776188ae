"""The media built-in's section of the config (`media:`)."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.media import FAMILY
from wrapper.configuration.config import Config
from wrapper.configuration.settings import DURATION, Section, choice, setting


@dataclass(frozen=True)
class MediaSettings:
    projector: str = setting("always", choice("always", "on_demand"),
                             "`on_demand`: start llama-server without the argv's `--mmproj` and load it (a reload "
                             "that keeps every conversation) when the first request with an image or audio "
                             "arrives; `always`: as given")
    idle: float = setting(900.0, DURATION, "with `on_demand`: the projector is dropped again after this long "
                          "without a request that carries media")


MEDIA = Section(FAMILY, MediaSettings, "images and audio: the projector on demand")


def on_demand(config: Config) -> bool:
    return MEDIA.of(config).projector == "on_demand"
