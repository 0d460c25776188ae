"""The configuration: one YAML file, every key optional, checked key by key with file:line in errors."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from wrapper.configuration import template
from wrapper.configuration.auth import MAKE_TOKEN, token_path
from wrapper.configuration.settings import Section
from wrapper.configuration.units import parse_duration
from wrapper.configuration.yamlread import Reader

HOOK_EVENTS = ("on_will_start", "on_startup", "on_will_stop", "on_stopped", "on_reload")
ACTION_KINDS = ("http", "shell", "exec", "builtin")
OVERLAP_POLICIES = ("auto", "always", "never")

ActionKind = Literal["http", "shell", "exec", "builtin"]


class ConfigError(Exception):
    """A configuration that cannot be used; each line of the message names file:line where it can."""


@dataclass(frozen=True)
class HttpRequest:
    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    json: Any = None
    body: str | None = None
    expect: tuple[int, ...] = ()  # empty: any 2xx


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    name: str
    where: str
    timeout: float = 30.0
    retries: int = 0
    ignore_errors: bool = False
    when: str | None = None
    http: HttpRequest | None = None
    shell: str | None = None
    exec: tuple[str, ...] = ()
    builtin: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # a built-in's `with:` mapping (templates rendered)


@dataclass(frozen=True)
class Listen:
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class Config:
    source: str | None = None
    listen: Listen | None = None  # None: llama-server's own --host/--port, else 127.0.0.1:8080
    argv: tuple[str, ...] = ()
    ready_timeout: float = 300.0
    stop_timeout: float = 10.0
    drain_timeout: float = 5.0
    stop_budget: float = 10.0  # what the process manager gives a stop before its SIGKILL: warn when one comes close
    env: dict[str, str] = field(default_factory=dict)
    allow_slot_actions: bool = False
    reload_overlap: str = "auto"  # start the new llama-server before stopping the old one
    reload_hold_timeout: float = 60.0  # how long a request may be held during a reload before a 503
    reload_drain_timeout: float = 30.0  # how long in-flight requests may finish before a reload cuts them
    admin_token_file: Path | None = None  # POST /wrapper/* needs this token (or LLAMA_WRAPPER_ADMIN_TOKEN)
    read_token_file: Path | None = None  # a token that reads the status and /metrics, and nothing else
    settings: Mapping[str, Any] = field(default_factory=dict)  # each section (wrapper/configuration/settings.py)
    hooks: dict[str, tuple[Action, ...]] = field(default_factory=lambda: {e: () for e in HOOK_EVENTS})
    warnings: tuple[str, ...] = ()  # file:line notes about things that work but are probably not meant

    def uses(self, family: str) -> bool:
        """True when a hook runs a built-in of this family (`slots` → the child is made fit for persistence)."""
        return any(a.kind == "builtin" and a.builtin.startswith(f"{family}.") for a in self.all_actions())

    def all_actions(self) -> list[Action]:
        return [action for event in HOOK_EVENTS for action in self.hooks[event]]

    def with_settings(self, changes: Mapping[str, Mapping[str, Any]]) -> Config:
        """The config with some built-in settings changed ({section: {field: value}}); the sections must exist."""
        if not changes:
            return self
        settings = dict(self.settings)
        for name, fields in changes.items():
            settings[name] = dataclasses.replace(settings[name], **fields)
        return replace(self, settings=settings)


def parse_listen(text: str) -> Listen:
    """`HOST:PORT`, `[v6]:PORT` or `:PORT` (loopback)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"write HOST:PORT with a port in 1-65535 (e.g. 127.0.0.1:8080), not {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    return Listen(host, int(port))


Check = Callable[["Config"], list[str]]
"""More problems of a config read (the built-ins' actions and options: wrapper/built_ins.py), `file:line: ...`."""


def load_config(path: str | os.PathLike[str], sections: Sequence[Section[Any]] = (), check: Check | None = None,
                ) -> Config:
    """Read and check a config file; raises ConfigError listing every problem with file:line, in line order.
    `sections`: the built-ins' own, `check` their other checks (wrapper/built_ins.py passes both)."""
    name = os.fspath(path)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read the config: {exc.strerror}") from exc
    return parse_config(text, name, sections, check)


_LINE = re.compile(r":(\d+): ")


def _in_line_order(problems: list[str]) -> list[str]:
    def line(problem: str) -> int:
        found = _LINE.search(problem)
        return int(found.group(1)) if found else 0

    return sorted(problems, key=line)  # stable: one line's problems as they were found


def parse_config(text: str, name: str = "<config>", sections: Sequence[Section[Any]] = (),
                 check: Check | None = None) -> Config:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{name}{line}: not valid YAML: {getattr(exc, 'problem', exc)}") from exc
    defaults = {section.name: section.kind() for section in sections if not section.optional}
    if root is None:
        return Config(source=name, settings=defaults)
    reader = Reader(name)
    config = _read_root(reader, root, sections)
    config = replace(config, warnings=tuple(reader.warnings), settings={**defaults, **config.settings})
    problems = [*reader.errors, *(check(config) if check is not None else [])]
    if problems:
        raise ConfigError("\n".join(_in_line_order(problems)))
    return config


def _read_root(r: Reader, root: yaml.Node, sections: Sequence[Section[Any]]) -> Config:
    top = r.mapping(root, "the config", ("listen", "server", *(s.name for s in sections), "proxy", "reload",
                                               "admin", "hooks"))
    values: dict[str, Any] = {"source": r.path,
                              "settings": {s.name: s.read(r, top[s.name]) for s in sections if s.name in top}}
    if "listen" in top:
        values["listen"] = r.converted(top["listen"], "listen", lambda v: parse_listen(str(v)))
    if "server" in top:
        server = r.mapping(
            top["server"], "server", ("argv", "ready_timeout", "stop_timeout", "drain_timeout", "stop_budget", "env")
        )
        if "argv" in server:
            values["argv"] = r.string_list(server["argv"], "server.argv")
        for key in ("ready_timeout", "stop_timeout", "drain_timeout", "stop_budget"):
            if key in server:
                values[key] = r.converted(server[key], f"server.{key}", parse_duration)
        if "env" in server:
            env = r.mapping(server["env"], "server.env", tuple(_keys(server["env"])))
            values["env"] = {k: str(r.scalar(v, f"server.env.{k}", (str, int, float))) for k, v in env.items()}
    if "proxy" in top:
        proxy = r.mapping(top["proxy"], "proxy", ("allow_slot_actions",))
        if "allow_slot_actions" in proxy:
            values["allow_slot_actions"] = r.scalar(proxy["allow_slot_actions"], "proxy.allow_slot_actions", (bool,))
    if "reload" in top:
        reload = r.mapping(top["reload"], "reload", ("overlap", "hold_timeout", "drain_timeout"))
        if "overlap" in reload:
            policy = r.scalar(reload["overlap"], "reload.overlap", (str,))
            if policy not in OVERLAP_POLICIES:
                r.error(reload["overlap"], f"reload.overlap must be one of {', '.join(OVERLAP_POLICIES)}")
            values["reload_overlap"] = policy
        for key in ("hold_timeout", "drain_timeout"):
            if key in reload:
                values[f"reload_{key}"] = r.converted(reload[key], f"reload.{key}", parse_duration)
    if "admin" in top:
        admin = r.mapping(top["admin"], "admin", ("token_file", "read_token_file"))
        for key, field_name, off in (("token_file", "admin_token_file", "the admin endpoints are off"),
                                     ("read_token_file", "read_token_file", "no token reads the status alone")):
            if key in admin:
                token_file = r.scalar(admin[key], f"admin.{key}", (str,))
                if token_file:
                    values[field_name] = token_path(token_file)
                    if not values[field_name].is_file():
                        r.warn(admin[key], f"admin.{key}: {values[field_name]} does not exist: {off} until it "
                               "does; " + MAKE_TOKEN.format(file=values[field_name]))
    if "hooks" in top:
        hooks = r.mapping(top["hooks"], "hooks", HOOK_EVENTS)
        values["hooks"] = {event: _read_actions(r, hooks[event], event) if event in hooks else ()
                           for event in HOOK_EVENTS}
    return Config(**{k: v for k, v in values.items() if v is not None})


def _keys(node: yaml.Node) -> list[str]:
    if isinstance(node, yaml.MappingNode):
        return [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
    return []


def _read_actions(r: Reader, node: yaml.Node, event: str) -> tuple[Action, ...]:
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    if not isinstance(node, yaml.SequenceNode):
        r.error(node, f"hooks.{event} must be a list of actions")
        return ()
    actions = []
    for index, item in enumerate(node.value):
        action = _read_action(r, item, f"hooks.{event}[{index}]", event)
        if action is not None:
            actions.append(action)
    return tuple(actions)


_ACTION_KEYS = ("name", "timeout", "retries", "ignore_errors", "when", "with", *ACTION_KINDS)
_HTTP_KEYS = ("method", "url", "headers", "json", "body", "expect")


def _read_action(r: Reader, node: yaml.Node, what: str, event: str) -> Action | None:
    keys = r.mapping(node, what, _ACTION_KEYS)
    kinds = [k for k in ACTION_KINDS if k in keys]
    if len(kinds) != 1:
        r.error(node, f"{what} needs exactly one of {', '.join(ACTION_KINDS)} (found {len(kinds)})")
        return None
    kind: ActionKind = kinds[0]  # type: ignore[assignment]
    body = keys[kind]
    fields: dict[str, Any] = {"kind": kind, "where": r.where(node)}
    if kind == "http":
        fields["http"] = _read_http(r, body, f"{what}.http")
    elif kind == "shell":
        fields["shell"] = r.scalar(body, f"{what}.shell", (str,))
    elif kind == "exec":
        fields["exec"] = r.string_list(body, f"{what}.exec")
    else:
        fields["builtin"] = r.scalar(body, f"{what}.builtin", (str,))  # names are checked by wrapper/built_ins
    if "with" in keys:
        options = r.value(keys["with"])
        if kind != "builtin":
            r.error(keys["with"], f"{what}.with: only a builtin action takes options")
        elif not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            r.error(keys["with"], f"{what}.with must be a mapping of option names to values")
        else:
            fields["options"] = options
    if "name" in keys:
        fields["name"] = r.scalar(keys["name"], f"{what}.name", (str,))
    if "timeout" in keys:
        fields["timeout"] = r.converted(keys["timeout"], f"{what}.timeout", parse_duration)
        if fields["timeout"] == 0:
            r.error(keys["timeout"], f"{what}.timeout must be more than 0")
    if "retries" in keys:
        retries = r.scalar(keys["retries"], f"{what}.retries", (int,))
        if retries is not None and not 0 <= retries <= 20:
            r.error(keys["retries"], f"{what}.retries must be between 0 and 20")
        fields["retries"] = retries
    if "ignore_errors" in keys:
        fields["ignore_errors"] = r.scalar(keys["ignore_errors"], f"{what}.ignore_errors", (bool,))
    if "when" in keys:
        fields["when"] = r.scalar(keys["when"], f"{what}.when", (str,))
    fields.setdefault("name", _default_name(fields))
    if not fields.get(kind):
        return None
    action = Action(**{k: v for k, v in fields.items() if v is not None})
    for problem in _template_problems(action, event):
        r.error(node, f"{what}: {problem}")
    program: str | None = action.exec[0] if action.exec else _first_word(action.shell)
    if program is not None and (unrunnable := _program_problem(program, on_path=bool(action.exec))) is not None:
        r.warn(node, f"{what}: {unrunnable}")
    if action.shell is not None:
        for quoted in template.quoted_templates(action.shell):
            r.warn(node, f"{what}: {quoted} stands inside quotes in a shell command; every {{{{ }}}} value is "
                         "quoted for the shell already, and the quotes around it undo that: remove them")
    return action


def _first_word(shell: str | None) -> str | None:
    try:
        words = shlex.split(shell or "")
    except ValueError:
        return None
    return words[0] if words and "=" not in words[0].partition("/")[0] else None  # not `VAR=value cmd`


def _program_problem(program: str, on_path: bool) -> str | None:
    """Why an action's program will not run, when that can be told now (a script path; an exec's command)."""
    if "{{" in program or "{%" in program:
        return None  # known only when the hook runs
    if "/" not in program:
        if on_path and shutil.which(program) is None:
            return f"{program!r} is not on PATH: the action will fail when it runs (give its full path)"
        return None  # a shell's first word may be one of its own commands
    path = Path(program).expanduser()
    if not path.exists():
        return f"{program} does not exist: the action will fail when it runs"
    if path.is_dir() or not os.access(path, os.X_OK):
        return f"{program} is not executable: the action will fail with 'Permission denied' (chmod +x {program})"
    return None


def _template_problems(action: Action, event: str) -> list[str]:
    """Templates are checked when the config is read: a typo fails `check` and `run` at once, with file:line."""
    texts = [action.shell or "", *action.exec]
    if action.http is not None:
        texts += [action.http.url, *action.http.headers.values(), action.http.body or "",
                  *_strings(action.http.json)]
    texts += _strings(action.options)
    found = [problem for text in texts if "{" in text for problem in template.problems(text, event=event)]
    if action.when is not None:
        found += template.problems(action.when, expression=True, event=event)
    return found


def _strings(value: Any) -> list[str]:
    """Every string in a JSON-like value, keys included (they are rendered too)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in (*_strings(str(key)), *_strings(item))]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def _default_name(fields: dict[str, Any]) -> str:
    kind = str(fields["kind"])
    if kind == "builtin":
        return str(fields.get("builtin") or "builtin")
    if kind == "http" and fields.get("http") is not None:
        request: HttpRequest = fields["http"]
        return f"{request.method} {request.url}"
    if kind == "exec" and fields.get("exec"):
        return str(fields["exec"][0])
    if kind == "shell" and fields.get("shell"):
        first = str(fields["shell"]).strip().splitlines()[0]
        return first if len(first) <= 40 else first[:37] + "..."
    return kind


def _read_http(r: Reader, node: yaml.Node, what: str) -> HttpRequest | None:
    keys = r.mapping(node, what, _HTTP_KEYS)
    if "url" not in keys:
        r.error(node, f"{what} needs a url")
        return None
    url = r.scalar(keys["url"], f"{what}.url", (str,))
    method = "GET"
    if "json" in keys or "body" in keys:
        method = "POST"
    if "method" in keys:
        method = str(r.scalar(keys["method"], f"{what}.method", (str,)) or method).upper()
    if "json" in keys and "body" in keys:
        r.error(node, f"{what}: give json or body, not both")
    headers: dict[str, str] = {}
    if "headers" in keys:
        raw = r.value(keys["headers"])
        if not isinstance(raw, dict) or not all(isinstance(v, str | int) for v in raw.values()):
            r.error(keys["headers"], f"{what}.headers must map names to strings")
        else:
            headers = {str(k): str(v) for k, v in raw.items()}
    body = r.scalar(keys["body"], f"{what}.body", (str,)) if "body" in keys else None
    expect: tuple[int, ...] = ()
    if "expect" in keys:
        raw = r.value(keys["expect"])
        raw = raw if isinstance(raw, list) else [raw]
        if not raw or not all(isinstance(s, int) and not isinstance(s, bool) and 100 <= s <= 599 for s in raw):
            r.error(keys["expect"], f"{what}.expect must be an HTTP status or a list of them")
        else:
            expect = tuple(raw)
    if url is None:
        return None
    return HttpRequest(method=method, url=url, headers=headers,
                       json=r.value(keys["json"]) if "json" in keys else None, body=body, expect=expect)
