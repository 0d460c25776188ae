"""Two classes of requests: interactive (a person waits) and background (an agent, a batch job), and the section
of the config that says how background ones are told apart and whether they yield their slot (`priority:`).

A request is background when its header says `X-Priority: background`, its body `"service_tier": "flex"` (the
OpenAI API's word for slower, cheaper work), an agent's own header says it is a subagent's or a side task's
(`AGENT_MARKS`, and those `priority.headers` adds or replaces), or its API key is one of `priority.background_keys`;
the header `X-Priority: interactive` and `"service_tier": "priority"` say interactive, and so does everything else
(the first of these that says a class decides, in this order; case and spaces aside; what the wrapper does not know
says nothing). Neither X-Priority nor `service_tier` goes on to llama-server; the agents' headers do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from wrapper.asked import Asked, Class
from wrapper.configuration import argv as args
from wrapper.configuration.auth import allowed, presented
from wrapper.configuration.sections import ANY_VALUE, HeaderMarks, PrioritySettings

HEADER = "X-Priority"
TIER = "service_tier"


# The agents' own marks: header -> {value -> class} (ANY_VALUE: any non-empty value); a value not here says nothing
# (agents add values over time: not logged). docs/priority.md's table says the same, with each agent's session header.
_BACKGROUND = Class.BACKGROUND
AGENT_MARKS: Mapping[str, Mapping[str, Class]] = MappingProxyType({
    # Claude Code (with CLAUDE_CODE_GATEWAY_HINT_HEADERS=1): main, its own loop, says nothing
    "x-claude-code-request-class": MappingProxyType(
        {"subagent": _BACKGROUND, "workflow": _BACKGROUND, "compaction": _BACKGROUND, "auxiliary": _BACKGROUND}),
    # Codex: review, compact, memory_consolidation, collab_spawn
    "x-openai-subagent": MappingProxyType({ANY_VALUE: _BACKGROUND}),
    # opencode: a subagent's request names its parent's session
    "x-parent-session-id": MappingProxyType({ANY_VALUE: _BACKGROUND}),
})


def classify(headers: Mapping[str, str], payload: dict[str, Any] | None, settings: PrioritySettings) -> Class:
    """The class a request asks for (X-Priority first, then `service_tier`, then the agents' headers, then its API
    key). `headers` are the request's (aiohttp's: any case)."""
    return classed(headers, payload, settings)[0]


def asked(path: str, consumer: str | None, headers: Mapping[str, str], payload: dict[str, Any] | None,
          settings: PrioritySettings) -> Asked:
    """Who asks and how (wrapper/asked.py): its class, the mark that decided it, the session it says it is of."""
    klass, by = classed(headers, payload, settings)
    return Asked(path, consumer, klass, by, session_of(headers, payload))


def classed(headers: Mapping[str, str], payload: dict[str, Any] | None,
            settings: PrioritySettings) -> tuple[Class, str]:
    """`classify`'s class, and the mark that decided it, in words (what the log says of each request)."""
    said = headers.get(HEADER, "").strip().lower()
    if said in (Class.BACKGROUND.value, Class.INTERACTIVE.value):
        return Class(said), f"{HEADER}: {said}"
    tier = _tier(payload)
    if tier in ("flex", "priority"):
        return (Class.BACKGROUND if tier == "flex" else Class.INTERACTIVE), f"{TIER}: {tier}"
    for name, values in header_marks(settings.headers):
        if (value := headers.get(name, "").strip().lower()) and (klass := values.get(value, values.get(ANY_VALUE))):
            return klass, f"the agents' header {name}"
    key = presented(headers)
    if key and allowed(settings.background_keys, key):
        return Class.BACKGROUND, "a background key (priority.background_keys)"
    return Class.INTERACTIVE, "no mark: a person, as any request without one"


@functools.lru_cache(maxsize=8)
def header_marks(configured: HeaderMarks) -> tuple[tuple[str, Mapping[str, Class]], ...]:
    """The header marks read, in order: the config's (`priority.headers`), then the built-in ones it does not name
    (a header named there replaces the built-in entry whole)."""
    named = {name for name, _ in configured}
    own = tuple((name, MappingProxyType({value: Class(word) for value, word in values})) for name, values in configured)
    return own + tuple((name, values) for name, values in AGENT_MARKS.items() if name not in named)


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


def unsaid(payload: dict[str, Any]) -> bool:
    """Take `service_tier` out of a request body (llama-server does not know it); whether it was there."""
    if TIER not in payload:
        return False
    del payload[TIER]
    return True


# opencode's, opencode's, Codex's, Claude Code's, OpenHands' (LiteLLM's): the first present
SESSION_HEADERS = ("X-Session-Id", "x-session-affinity", "session_id", "x-claude-code-session-id",
                   "x-litellm-session-id")
SESSION_FIELDS = ("prompt_cache_key", "session_id")  # Codex's Responses body, and others'


def session_of(headers: Mapping[str, str], payload: dict[str, Any] | None) -> str | None:
    """The session an agent says a request belongs to (its header, else its body's `prompt_cache_key`): for the log
    and the status; llama-server ignores these fields, so they go on as they came."""
    for name in SESSION_HEADERS:
        if value := headers.get(name, "").strip():
            return _shown_mark(value)
    for name in SESSION_FIELDS:
        field = payload.get(name) if payload is not None else None
        if isinstance(field, str) and field.strip():
            return _shown_mark(field.strip())
    return None


def _shown_mark(value: str) -> str:
    printable = "".join(c for c in value if c.isprintable())
    return printable[:64]


LANE_WHY = "one slot more, kept for interactive requests (priority.lane)"


def lane(settings: PrioritySettings, argv: list[str], slots_fit_kvu: bool) -> tuple[bool, str]:
    """Whether one slot is kept for interactive requests, and why: `priority.lane` true, or `auto` whenever one KV
    serves all slots (the argv's, or the -kvu the slot built-ins' fit adds: `slots_fit_kvu`), where a slot more costs
    no KV memory, whatever marks the config uses; `auto` is off where the slots have a KV each (a slot more would
    take its share of -c), and the why says what to set."""
    if settings.lane is False:
        return False, "priority.lane is false"
    unified = args.unified_kv(argv) or (slots_fit_kvu and args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED)
                                        is None)
    split = args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) is False  # the argv says -no-kvu itself
    if settings.lane is None and not unified:
        return False, (f"the slots have a KV each ({'-no-kvu' if split else '-np without -kvu'}): a slot more "
                       f"would take its share of -c; {'drop -no-kvu, or ' if split else 'add -kvu, or '}set "
                       f"priority.lane: true ({'keeps -no-kvu' if split else 'adds -kvu'}) to keep a slot for people")
    if unified:
        return True, LANE_WHY + " on one KV: it costs no KV memory"
    return True, LANE_WHY + (", -no-kvu kept as given: its slot takes a share of -c" if split else ", with -kvu added")


def with_lane(argv: list[str], kvu: bool) -> tuple[list[str], list[dict[str, str]]]:
    """The argv with the lane: -np one more (none given: llama-server's automatic slots, which share one KV, keep one
    of theirs), and one KV (-kvu, when the binary has it: `kvu`) when the argv does not say; the notes saying so."""
    notes = []
    given = args.get(argv, args.PARALLEL)
    if given is not None and given.strip().isdigit() and int(given) > 0:
        argv = args.replace(argv, args.PARALLEL, str(int(given) + 1))
        notes.append({"change": f"-np {given} -> {int(given) + 1}", "why": LANE_WHY})
    if kvu and args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) is None and not args.unified_kv(argv):
        argv = [*argv, "-kvu"]
        notes.append({"change": "-kvu", "why": "the lane's slot shares the one KV: it costs no KV memory"})
    return argv, notes
