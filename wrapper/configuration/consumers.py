"""The consumers of one model (`consumers:`): a name for each API key, what each may keep (its share), whether one
is served from what another kept (`isolate`), and the public beginning every one may reuse (`shared_prefix`). A
request whose key no entry names, or that sends none, is the consumer `anonymous`. Read here; the conversation
cache (hooks/conversations) keeps them apart."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from wrapper.configuration.auth import presented
from wrapper.configuration.sections import AUTO_BOOL
from wrapper.configuration.settings import Kind, Section, setting
from wrapper.configuration.units import format_size, parse_size
from wrapper.configuration.yamlread import Reader

ANONYMOUS = "anonymous"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SHARE_KEYS = ("folder", "bucket", "slots")

# consumers.keys as read: (name, (key, ...)), in the config's order
NamedKeys = tuple[tuple[str, tuple[str, ...]], ...]
# consumers.by_header as read: (consumer, header), in the config's order
ByHeader = tuple[tuple[str, str], ...]
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")  # an HTTP header's name (a token)
USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@:+-]{0,127}")  # a front-end's user id: a name, an email, a UUID
USER_OF = "/"  # `open-webui/42`: user 42 of the front-end consumer open-webui
SALTED = "#"  # `alice#3f9a…`: alice's requests of one cache_salt (a digest of it: the salt is never kept)


class NotAUser(ValueError):
    """A front-end's user header whose value cannot be a name (the request is refused with a 400 that says so)."""


@dataclass(frozen=True)
class Share:
    """What one consumer may keep: bytes in the slot folder and in the bucket, slots holding its conversations
    (None: no bound of its own)."""

    folder: int | None = None
    bucket: int | None = None
    slots: int | None = None

    def shown(self) -> dict[str, Any]:
        return {k: (format_size(v) if k != "slots" else v) for k in SHARE_KEYS if (v := getattr(self, k)) is not None}


Shares = tuple[tuple[str, Share], ...]


def _name(r: Reader, node: yaml.Node, what: str) -> str | None:
    name = node.value if isinstance(node, yaml.ScalarNode) else None
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        r.error(node, f"{what}: a consumer's name is 1 to 64 letters, digits, '_', '.' or '-' (it is shown in the "
                      "status and in /metrics labels)")
        return None
    return name


def _named_keys(r: Reader, node: yaml.Node, what: str) -> NamedKeys | None:
    """name -> a key or a list of keys (never echoed, also not in an error)."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    example = 'alice: ["sk-alice"]'
    if not isinstance(node, yaml.MappingNode):
        r.error(node, f"{what} must be a mapping of consumer name -> its API keys, e.g. {{{example}}}")
        return None
    named: list[tuple[str, tuple[str, ...]]] = []
    seen_keys: dict[str, str] = {}  # key -> the consumer it was given to
    ok = True
    for name_node, keys_node in node.value:
        name = _name(r, name_node, what)
        if name is None:
            ok = False
            continue
        if name == ANONYMOUS:
            r.error(name_node, f"{what}: {ANONYMOUS!r} is the consumer of requests no key names; it has no keys")
            ok = False
            continue
        if any(name == n for n, _ in named):
            r.error(name_node, f"{what}: consumer {name!r} given twice")
            ok = False
            continue
        items = keys_node.value if isinstance(keys_node, yaml.SequenceNode) else [keys_node]
        keys: list[str] = []
        for item in items:
            if not isinstance(item, yaml.ScalarNode) or item.tag != "tag:yaml.org,2002:str" or not item.value:
                r.error(item, f"{what}.{name}: each key must be a non-empty string (its value is not shown): quote "
                              "it")
                ok = False
            elif item.value in seen_keys:
                other = seen_keys[item.value]
                r.error(item, f"{what}.{name}: " + ("this key is given twice" if other == name else
                                                    f"this key is {other}'s too: one key, one consumer")
                        + " (its value is not shown)")
                ok = False
            else:
                seen_keys[item.value] = name
                keys.append(str(item.value))
        if not keys and ok:
            r.error(keys_node, f"{what}.{name}: give at least one key, e.g. {example}")
            ok = False
        named.append((name, tuple(keys)))
    return tuple(named) if ok else None


def _by_header(r: Reader, node: yaml.Node, what: str) -> ByHeader | None:
    """consumer -> the header its front-end names its user in."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    if not isinstance(node, yaml.MappingNode):
        r.error(node, f"{what} must be a mapping of consumer name -> the header its users are named in, e.g. "
                      "{open-webui: X-OpenWebUI-User-Id}")
        return None
    out: list[tuple[str, str]] = []
    for name_node, header_node in node.value:
        name = _name(r, name_node, what)
        header = header_node.value if isinstance(header_node, yaml.ScalarNode) else None
        if name is None:
            return None
        if not isinstance(header, str) or not _HEADER.fullmatch(header):
            r.error(header_node, f"{what}.{name}: the name of an HTTP header, e.g. X-OpenWebUI-User-Id")
            return None
        out.append((name, header))
    return tuple(out)


def _shares(r: Reader, node: yaml.Node, what: str) -> Shares | None:
    """name -> {folder: SIZE, bucket: SIZE, slots: N}."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return ()
    example = "agent: {folder: 2GiB, bucket: 10GiB, slots: 1}"
    if not isinstance(node, yaml.MappingNode):
        r.error(node, f"{what} must be a mapping of consumer name -> its share, e.g. {{{example}}}")
        return None
    shares: list[tuple[str, Share]] = []
    ok = True
    for name_node, share_node in node.value:
        name = _name(r, name_node, what)
        if name is None or any(name == n for n, _ in shares):
            if name is not None:
                r.error(name_node, f"{what}: consumer {name!r} given twice")
            ok = False
            continue
        given = r.mapping(share_node, f"{what}.{name}", SHARE_KEYS)
        values: dict[str, int] = {}
        for key, value_node in given.items():
            if key == "slots":
                value = r.scalar(value_node, f"{what}.{name}.slots", (int,))
                if isinstance(value, int) and value < 1:
                    r.error(value_node, f"{what}.{name}.slots must be 1 or more (the slots its conversations may "
                                        "hold at once)")
                    value = None
            else:
                value = r.converted(value_node, f"{what}.{name}.{key}", parse_size)
            if value is None:
                ok = False
            else:
                values[key] = int(value)
        shares.append((name, Share(**values)))
    return tuple(shares) if ok else None


def _shared_prefix(r: Reader, node: yaml.Node, what: str) -> str | None:
    """{messages: [...], tools: [...]} (a chat request's beginning) or {prompt: TEXT}; kept as JSON text."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "~", "null"):
        return None
    given = r.mapping(node, what, ("messages", "tools", "prompt"))
    value = {key: r.value(v) for key, v in given.items()}
    if not value:
        if isinstance(node, yaml.MappingNode):
            r.error(node, f"{what} must say `messages` (and `tools`) or `prompt`")
        return None
    if "prompt" in value and len(value) > 1:
        r.error(node, f"{what}: either `prompt` or `messages` (with `tools`), not both")
        return None
    if "prompt" in value and not isinstance(value["prompt"], str):
        r.error(given["prompt"], f"{what}.prompt must be a text")
        return None
    if "tools" in value and "messages" not in value:
        r.error(given["tools"], f"{what}: `tools` come with `messages` (the system prompt they follow)")
        return None
    for key in ("messages", "tools"):
        items = value.get(key)
        if items is not None and (not isinstance(items, list) or not all(isinstance(i, dict) for i in items)):
            r.error(given[key], f"{what}.{key} must be a list of mappings, as in a chat request's body")
            return None
    for i, message in enumerate(value.get("messages") or []):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str | list):
            r.error(given["messages"], f"{what}.messages[{i}] must have a `role` and a `content`, as a chat request's "
                                       "message: e.g. {role: system, content: \"You are ...\"}")
            return None
    return json.dumps(value, sort_keys=True)


def _shown_prefix(text: str | None) -> Any:
    if text is None:
        return "none"
    value = json.loads(text)
    if "prompt" in value:
        return f"a prompt of {len(value['prompt'])} characters"
    return f"{len(value['messages'])} messages, {len(value.get('tools') or [])} tools"


NAMED_KEYS = Kind("mapping: name → API keys (secret)", _named_keys,
                  lambda v: {name: f"({len(keys)} set)" for name, keys in v} if v else "none")
SHARES = Kind("mapping: name → {folder, bucket, slots}", _shares,
              lambda v: {name: share.shown() for name, share in v} if v else "none")
SHARED_PREFIX = Kind("{messages, tools} | {prompt}", _shared_prefix, _shown_prefix)
BY_HEADER = Kind("mapping: consumer → header", _by_header, lambda v: dict(v) if v else "none")


@dataclass(frozen=True)
class ConsumerSettings:
    keys: NamedKeys = setting((), NAMED_KEYS, "a name for each API key (`Authorization: Bearer KEY` or `X-Api-Key: "
                              "KEY`): the consumer a request is, in the status, /metrics and the store (a request "
                              "with no key, or one not named here, is `anonymous`); keys are never shown")
    by_header: ByHeader = setting((), BY_HEADER, "users behind one consumer's key (a chat front-end's): a request "
                                  "with that consumer's key and this header is the consumer `<consumer>/<value>`, "
                                  "private under isolation like any consumer, bounded by the consumer's share; the "
                                  "header counts only with that key")
    shares: Shares = setting((), SHARES, "what each consumer (or `anonymous`) may keep: `folder` and `bucket` bytes, "
                             "`slots` holding its conversations; one over its share loses its own oldest "
                             "conversations first, one under it keeps what it has")
    isolate: bool | None = setting(None, AUTO_BOOL, "serve a request only from what its own consumer kept (slots, "
                                   "folder, bucket) beyond `shared_prefix`, so that no answer's speed tells one "
                                   "consumer what another asked (`auto`: on when more than one consumer is named)")
    shared_prefix: str | None = setting(None, SHARED_PREFIX, "the public beginning every consumer may reuse under "
                                        "`isolate`: a chat request's `messages` (the system prompt) and `tools` as "
                                        "every client sends them, or a completion's `prompt`")


CONSUMERS = Section("consumers", ConsumerSettings, "each consumer's conversations are its own: a name per API key, "
                    "isolation, shares")


def named(settings: ConsumerSettings) -> tuple[str, ...]:
    return tuple(name for name, _ in settings.keys)


def on(settings: ConsumerSettings) -> bool:
    """Whether requests are told apart by consumer at all (a consumer named, or a share given)."""
    return bool(settings.keys or settings.shares)


def isolating(settings: ConsumerSettings) -> bool:
    return settings.isolate if settings.isolate is not None else len(settings.keys) > 1


def share_of(settings: ConsumerSettings, name: str) -> Share:
    """A consumer's share, by the rule `share_for` bounds it with (a front-end's user: its front-end's)."""
    given = dict(settings.shares)
    return given.get(_share_name(given, name) or "", Share())


def consumer_of(headers: Mapping[str, str], settings: ConsumerSettings) -> str | None:
    """The consumer a request is, by its key (every key compared, each in constant time), and for a consumer with
    `by_header` its user (`open-webui/42`); None when consumers are not configured. NotAUser: a user header whose
    value cannot be a name."""
    if not on(settings):
        return None
    key = presented(headers).encode()
    found = ANONYMOUS
    if key:
        for name, keys in settings.keys:
            if any([hmac.compare_digest(key, k.encode()) for k in keys]) and found == ANONYMOUS:
                found = name
    header = dict(settings.by_header).get(found)
    user = headers.get(header, "").strip() if header is not None else ""
    if not user:
        return found
    if not USER.fullmatch(user):
        raise NotAUser(f"{header}: a user is named by 1 to 128 letters, digits, '_', '.', '@', ':', '+' or '-', "
                       "beginning with a letter or a digit (it is shown in the status, /metrics and the log)")
    return f"{found}{USER_OF}{user}"


def known(settings: ConsumerSettings, consumer: str) -> bool:
    """Whether `consumer` is one a request may be: a named one, `anonymous`, or a user of a `by_header` consumer."""
    front_end, _, user = consumer.partition(USER_OF)
    if not user:
        return consumer in (*named(settings), ANONYMOUS)
    return front_end in dict(settings.by_header) and USER.fullmatch(user) is not None


def salted(consumer: str | None, salt: str) -> str:
    """The owner of a request's conversations when it sets `cache_salt` (vLLM's): its consumer's, private to that
    salt — a digest of it, so that the salt itself is never kept, shown or logged."""
    digest = hashlib.sha256(salt.encode()).hexdigest()[:16]
    return f"{consumer or ANONYMOUS}{SALTED}{digest}"


def is_salted(owner: str | None) -> bool:
    return owner is not None and SALTED in owner


def name_of(owner: str) -> str:
    """The consumer an owner is (its salt left out): what the status, /metrics and the shares count it as."""
    return owner.split(SALTED, 1)[0]


def share_for(shares: Mapping[str, int], owner: str | None) -> int | None:
    """What an owner may keep of one kind of share: its consumer's own, else (a front-end's user) its front-end's —
    a share given to `open-webui` bounds each of its users."""
    share = _share_name(shares, owner)
    return shares[share] if share is not None else None


def _share_name(shares: Mapping[str, object], owner: str | None) -> str | None:
    """The consumer whose share bounds `owner`: its own name (its salt left out), else its front-end's."""
    if owner is None:
        return None
    name = name_of(owner)
    front_end = name.split(USER_OF, 1)[0]
    return name if name in shares else front_end if front_end in shares else None


def problems(settings: ConsumerSettings) -> list[str]:
    """What the keys, shares and user headers say of each other: a share or a user header for a consumer no key
    names."""
    known = {*named(settings), ANONYMOUS}
    return [f"consumers.shares.{name}: no consumer of that name in consumers.keys (a share is for a named consumer "
            f"or {ANONYMOUS})" for name, _ in settings.shares if name not in known] + \
        [f"consumers.by_header.{name}: no consumer of that name in consumers.keys (its users are told apart only "
         "with its key)" for name, _ in settings.by_header if name not in named(settings)]
