"""The spec built-in's section of the config (`spec:`)."""

from __future__ import annotations

from dataclasses import dataclass

from hooks.speculative import FAMILY
from wrapper.configuration.config import Config
from wrapper.configuration.settings import DURATION, NUMBER, Section, choice, setting


@dataclass(frozen=True)
class SpecSettings:
    when: str = setting("always", choice("always", "alone"),
                        "`alone`: speculative decoding in the argv (a draft model with its `--spec-type`, or an "
                        "n-gram type) only while at most one request decodes, and only while it pays; `always`: "
                        "as given")
    calm: float = setting(30.0, DURATION, "how long a crowd (or being alone again) must last before the draft is "
                          "switched (each switch is a reload)")
    alone_speedup: float | None = setting(None, NUMBER, "tokens/s with the draft over without, alone (not given: "
                                          "measured from the answers' timings)")


SPEC = Section(FAMILY, SpecSettings, "speculative decoding only while it pays")


def switching(config: Config) -> bool:
    return SPEC.of(config).when == "alone"
