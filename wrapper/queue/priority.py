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
from enum import Enum
from typing import Any

from wrapper.configuration.sections import PrioritySettings

HEADER = "X-Priority"
TIER = "service_tier"


class Class(Enum):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


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
