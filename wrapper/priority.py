"""Two classes of requests: interactive (a person waits) and background (an agent, a batch job), and the section
of the config that says how background ones are told apart and whether they yield their slot (`priority:`).

A request is background when its header says `X-Priority: background`, its body `"service_tier": "flex"` (the
OpenAI API's word for slower, cheaper work), or its API key is one of `priority.background_keys`; the header
`X-Priority: interactive` and `"service_tier": "priority"` say interactive, and so does everything else (the first
of these that says a class decides; case and spaces aside; what the wrapper does not know says nothing). Neither
the header nor `service_tier` goes on to llama-server.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import yaml

from wrapper.settings import COUNT, Kind, Section, setting
from wrapper.yamlread import Reader

HEADER = "X-Priority"
TIER = "service_tier"


class Class(Enum):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


def _keys(r: Reader, node: yaml.Node, what: str) -> tuple[str, ...] | None:
    """API keys: a list of strings, never echoed (also not in an error)."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    if not isinstance(node, yaml.SequenceNode):
        r.error(node, f"{what} must be a list of API keys, e.g. {what.rsplit('.', 1)[-1]}: [\"agent-key\"] "
                      "(its value is not shown)")
        return None
    keys = []
    for i, item in enumerate(node.value):
        if not isinstance(item, yaml.ScalarNode) or item.tag != "tag:yaml.org,2002:str" or not item.value:
            r.error(item, f"{what}[{i}] must be a non-empty string (its value is not shown): quote it")
            return None
        keys.append(str(item.value))
    return tuple(keys)


def _preempt(r: Reader, node: yaml.Node, what: str) -> bool | None:
    """true, false or auto (None, the default; after an error too, which refuses the config)."""
    value = r.value(node)
    if isinstance(node, yaml.ScalarNode) and (isinstance(value, bool) or value == "auto"):
        return None if value == "auto" else bool(value)
    r.error(node, f"{what} must be true, false or auto, not {value!r}")
    return None


KEYS = Kind("list of API keys (secret)", _keys, lambda v: f"({len(v)} set)" if v else "none")
PREEMPT = Kind("true | false | auto", _preempt, lambda v: "auto" if v is None else v)


@dataclass(frozen=True)
class PrioritySettings:
    preempt: bool | None = setting(None, PREEMPT, "pause a background generation when an interactive request finds no "
                           "free slot, and resume it once one is free, from where it stopped (`auto`: on when the "
                           "conversation cache is on, which keeps the paused state)")
    max_pauses: int = setting(3, COUNT, "how many times one background request may be paused; past that it runs "
                              "to its end (0: never paused, only queued behind interactive ones)")
    background_keys: tuple[str, ...] = setting((), KEYS, "API keys (`Authorization: Bearer KEY`) whose requests "
                                               "are background: give an agent its own key and it needs no change; "
                                               "never shown")


PRIORITY = Section("priority", PrioritySettings, "interactive requests first: background ones yield their slot")


def classify(headers: Mapping[str, str], payload: dict[str, Any] | None, settings: PrioritySettings) -> Class:
    """The class a request asks for (the header first, then `service_tier`, then its API key)."""
    said = headers.get(HEADER, "").strip().lower()
    if said in (Class.BACKGROUND.value, Class.INTERACTIVE.value):
        return Class(said)
    tier = _tier(payload)
    if tier == "flex":
        return Class.BACKGROUND
    if tier == "priority":
        return Class.INTERACTIVE
    key = _api_key(headers)
    if key and any(hmac.compare_digest(key.encode(), k.encode()) for k in settings.background_keys):
        return Class.BACKGROUND
    return Class.INTERACTIVE


def _tier(payload: dict[str, Any] | None) -> Any:
    tier = payload.get(TIER) if payload is not None else None
    return tier.strip().lower() if isinstance(tier, str) else tier


KNOWN_TIERS = ("flex", "priority", "auto", "default", "scale")  # the OpenAI API's (the last three: interactive)


def odd_marks(headers: Mapping[str, str], payload: dict[str, Any] | None) -> list[str]:
    """What a request says of its class that the wrapper does not know (an X-Priority other than background or
    interactive, a service_tier it has no meaning for): read as not said, and logged once each."""
    odd = []
    said = headers.get(HEADER)
    if said is not None and said.strip().lower() not in (Class.BACKGROUND.value, Class.INTERACTIVE.value):
        odd.append(f"{HEADER}: {said[:40]}")
    tier = _tier(payload)
    if tier is not None and tier not in KNOWN_TIERS:
        odd.append(f"{TIER}: {json.dumps(tier)[:40]}")
    return odd


def _api_key(headers: Mapping[str, str]) -> str:
    auth = headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("X-Api-Key", "").strip()


def unsaid(payload: dict[str, Any]) -> bool:
    """Take `service_tier` out of a request body (llama-server does not know it); whether it was there."""
    if TIER not in payload:
        return False
    del payload[TIER]
    return True
