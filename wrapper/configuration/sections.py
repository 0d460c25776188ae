"""The wrapper's own sections of the config (`watchdog:`, `priority:`, `sleep:`, `router:`), declared as the
built-ins' are (wrapper/configuration/settings.py) and read with theirs: the features that use them
(wrapper/life/watchdog.py, wrapper/queue/priority.py, wrapper/life/sleeping.py, wrapper/http/gauges.py) sit above
the built-ins, and their sections below."""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from wrapper.configuration.settings import BOOL, COUNT, POSITIVE_DURATION, Kind, Section, setting
from wrapper.configuration.units import parse_duration
from wrapper.configuration.yamlread import Reader


@dataclass(frozen=True)
class WatchdogSettings:
    enabled: bool = setting(True, BOOL, "watch llama-server: start it again when it crashes or hangs, hold the "
                            "requests meanwhile and go on with those in flight (false: no hang is looked for, and a "
                            "crash stops the wrapper)")
    health_timeout: float = setting(30.0, POSITIVE_DURATION, "llama-server is hung when its /health goes unanswered "
                                    "this long (it answers in milliseconds, a long prefill included); noticed within "
                                    "this and one look more (every 5 s at most)")
    stall: float = setting(300.0, POSITIVE_DURATION, "llama-server is hung when a request in flight hears nothing "
                           "and the server makes no progress this long: no slot does (a task taken, a prompt batch "
                           "done, a token decoded) and its CPU time stands still (Linux: a long prompt batch "
                           "computes, a stopped or blocked server does not, so a short stall is safe); without /proc, "
                           "more than its slowest prompt batch takes (minutes for a large model on a CPU)")
    restarts: int = setting(3, COUNT, "how many times it is started again within `window`; past that the wrapper "
                            "stops with the server's exit status (llama-swap or systemd take over)")
    window: float = setting(600.0, POSITIVE_DURATION, "the window the restarts are counted in")
    replay_tokens: int = setting(1024, COUNT, "an answer lost in a tool call that samples repeatably (temperature 0, "
                                 "or a seed: the wrapper gives one to a request without one, except on Messages) is "
                                 "generated again from the start when at most this many of its tokens were "
                                 "generated (a decode step each, again): it then is the uncut answer, and the "
                                 "client is shown only what it lacks; a longer one goes on from the call's "
                                 "arguments, read in one batch, and may go on another way (0: always from the "
                                 "arguments)")


WATCHDOG = Section("watchdog", WatchdogSettings, "llama-server started again after a crash or a hang")


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


CLASSES = ("background", "interactive")
ANY_VALUE = "*"
# priority.headers as read: (header, ((value, class), ...)), in the config's order; names and values lower case
HeaderMarks = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


def _header_marks(r: Reader, node: yaml.Node, what: str) -> HeaderMarks | None:
    """header -> {value -> background | interactive}, `*` for any value; names and values as written (not YAML's
    booleans or numbers), case and spaces aside."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    example = 'x-my-batch-job: {"*": background}'
    if not isinstance(node, yaml.MappingNode):
        r.error(node, f"{what} must be a mapping of header -> {{value: background | interactive}}, e.g. {{{example}}}")
        return None
    marks: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    ok = True
    for name_node, values_node in node.value:
        name = name_node.value.strip().lower() if isinstance(name_node, yaml.ScalarNode) else ""
        if not name:
            r.error(name_node, f"{what}: a header's name must be a non-empty string")
            ok = False
            continue
        if any(name == seen for seen, _ in marks):
            r.error(name_node, f"{what}: header {name!r} given twice (names are read in any case)")
            ok = False
            continue
        if not isinstance(values_node, yaml.MappingNode):
            r.error(values_node, f"{what}.{name} must be a mapping of value -> background | interactive "
                                 f"(\"*\": any value), e.g. {example}")
            ok = False
            continue
        values: list[tuple[str, str]] = []
        for value_node, class_node in values_node.value:
            value = value_node.value.strip().lower() if isinstance(value_node, yaml.ScalarNode) else ""
            word = class_node.value.strip().lower() if isinstance(class_node, yaml.ScalarNode) else ""
            if not value or any(value == seen for seen, _ in values):
                r.error(value_node, f"{what}.{name}: each value must be a non-empty string, given once "
                                    "(\"*\": any value)")
                ok = False
            elif word not in CLASSES:
                r.error(class_node, f"{what}.{name}.{value} must be {' or '.join(CLASSES)}, not "
                                    f"{r.value(class_node)!r}")
                ok = False
            else:
                values.append((value, word))
        marks.append((name, tuple(values)))
    return tuple(marks) if ok else None


KEYS = Kind("list of API keys (secret)", _keys, lambda v: f"({len(v)} set)" if v else "none")
HEADER_MARKS = Kind("mapping: header → {value → background | interactive}", _header_marks,
                    lambda v: {name: dict(values) for name, values in v} if v else "none")
PREEMPT = Kind("true | false | auto", _preempt, lambda v: "auto" if v is None else v)
AUTO_BOOL = PREEMPT  # the same three words for any switch whose default the wrapper decides


@dataclass(frozen=True)
class PrioritySettings:
    preempt: bool | None = setting(None, PREEMPT, "pause a background generation when an interactive request finds no "
                           "free slot, and resume it once one is free, from where it stopped (`auto`: on when the "
                           "conversation cache is on, which keeps the paused state)")
    max_pauses: int = setting(3, COUNT, "how many times one background request may be paused; past that it runs "
                              "to its end (0: never paused, only queued behind interactive ones)")
    background_keys: tuple[str, ...] = setting((), KEYS, "API keys (`Authorization: Bearer KEY` or `X-Api-Key: "
                                               "KEY`) whose requests are background: give an agent its own key and "
                                               "it needs no change; never shown")
    headers: HeaderMarks = setting((), HEADER_MARKS, "headers that say a request's class, beside the agents' own "
                                   "(docs/priority.md): `\"*\"` for any non-empty value (a value named wins), e.g. "
                                   "`x-my-batch-job: {\"*\": background}`; a header named here replaces the built-in "
                                   "entry for it whole; read after X-Priority and service_tier, before the key; names "
                                   "and values in any case")
    lane: bool | None = setting(None, AUTO_BOOL, "keep one slot for interactive requests: llama-server runs one slot "
                                "more than -np, and background requests take at most -np of them, so a person's "
                                "request is answered beside an agent's at once, not after it or after its pause "
                                "(`auto`: on whenever the slots share one KV, as they do with the slot built-ins: the "
                                "slot then costs no KV memory; off where the slots have a KV each, said in the log)")


PRIORITY = Section("priority", PrioritySettings, "interactive requests first: background ones yield their slot")


def _duration_or_off(r: Reader, node: yaml.Node, what: str) -> float | None:
    """A duration > 0, or off (`off`, `false`, null: the default)."""
    value = r.value(node)
    if isinstance(node, yaml.ScalarNode) and (value is None or value is False or value in ("", "~", "off")):
        return None
    seconds = r.converted(node, what, parse_duration)
    if seconds is not None and not seconds > 0:
        r.error(node, f"{what} must be more than 0s, or off")
        return None
    return float(seconds) if seconds is not None else None


DURATION_OR_OFF = Kind("duration | off", _duration_or_off, lambda v: "off" if v is None else f"{v:g}s")


@dataclass(frozen=True)
class SleepSettings:
    after: float | None = setting(None, DURATION_OR_OFF, "fall asleep after this long with no request in flight or "
                                  "arriving: every slot kept, llama-server stopped (its memory free); the next "
                                  "request wakes it (off: never on its own; POST /wrapper/sleep still works)")
    when_asked: float | None = setting(None, DURATION_OR_OFF, "in a pool (degrade.pool): fall asleep when another "
                                       "member needs more than the others' ladders give, once idle this long, and "
                                       "give it the whole share (off: never asked)")


SLEEP = Section("sleep", SleepSettings, "an idle model gives its memory back and wakes with every conversation")


_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_TAKEN = ("llama_wrapper_", "llamacpp:")  # the wrapper's families and llama-server's, served before the gauges


def _metric_name(r: Reader, node: yaml.Node, what: str) -> str | None:
    """A Prometheus metric name, or '' (the gauge left out)."""
    value = r.scalar(node, what, (str,))
    if isinstance(value, str) and value.startswith(_TAKEN):
        r.error(node, f"{what}: {value!r} is in a family /metrics already serves ({', '.join(_TAKEN)}*): "
                      "one name would then be two families, and a scraper refuses the whole text; choose another")
        return None
    if value is None or value == "" or _METRIC_NAME.fullmatch(value):
        return value  # type: ignore[no-any-return]
    r.error(node, f"{what} must be a Prometheus metric name (letters, digits, _ and :, not first a digit), or '' to "
                  f"leave the gauge out; not {value!r}")
    return None


METRIC_NAME = Kind("metric name | ''", _metric_name, lambda v: v or "(left out)")


@dataclass(frozen=True)
class RouterGaugeSettings:
    waiting: str = setting("vllm:num_requests_waiting", METRIC_NAME, "the gauge of requests waiting for a slot (in "
                           "the queue, or held while llama-server starts, reloads or is restarted): the name a "
                           "router's load-aware scorer reads (the endpoint picker's default)")
    running: str = setting("vllm:num_requests_running", METRIC_NAME, "the gauge of requests in a slot now")
    kv_usage: str = setting("vllm:kv_cache_usage_perc", METRIC_NAME, "the gauge of the KV cache's use, from 0 to 1: "
                            "the tokens the slots hold over the context llama-server runs (known with the slot "
                            "built-ins, which track what each slot holds; left out without them; 0 while asleep)")


ROUTER = Section("router", RouterGaugeSettings, "the gauges a router in front reads from /metrics, by name")


def router_clashes(names: RouterGaugeSettings) -> list[str]:
    """The gauges given one name twice (a scraper refuses a family given twice)."""
    given = {"waiting": names.waiting, "running": names.running, "kv_usage": names.kv_usage}
    seen: dict[str, str] = {}
    found = []
    for key, name in given.items():
        if name and name in seen:
            found.append(f"router.{seen[name]} and router.{key} are both {name!r}: give each gauge its own name "
                         "('' leaves one out)")
        seen.setdefault(name, key)
    return found
