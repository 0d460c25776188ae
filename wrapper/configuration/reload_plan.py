"""What a reload asks for, turned into the next llama-server argv; refused before anything stops if it can't be.

The fields are those of llama-manager's `ReloadParams` that upstream llama-server can honour, plus free argv
edits: n_ctx, cache_type_k, cache_type_v, swa_full, kv_unified, spec {types: ["none"]},
mmproj {path, mmproj_offload}, args {set: {FLAG: VALUE}, remove: [FLAG]}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from wrapper.configuration import argv as args

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FIELDS = ("n_ctx", "cache_type_k", "cache_type_v", "swa_full", "kv_unified", "spec", "mmproj", "args")
# The wrapper owns these: a reload keeps the model, the private address, the slot folder and the keys.
PROTECTED = {"--host": "the wrapper's private address", "--port": "the wrapper's private address",
             "--slot-save-path": "the wrapper's slot folder", "-m": "the model (llama-swap swaps models)",
             "--model": "the model (llama-swap swaps models)", "--api-key": "the API keys",
             "--api-key-file": "the API keys"}
_MMPROJ_PATHS = ("-mm", "--mmproj", "-mmu", "--mmproj-url")


BUSY_RELOADING = "a reload is running: one at a time"


class Refusal(Enum):
    """Why a reload was refused, for callers that act on it (a growth waits for a busy one)."""

    INVALID = "invalid"  # the request asks for something that cannot be done
    NOTHING_TO_CHANGE = "nothing to change"
    BUSY = "busy"  # another reload runs: try again after it
    NOT_READY = "not ready"  # starting or stopping


class ReloadRefused(Exception):
    """A reload that cannot be done as asked; nothing was stopped. `status` is the HTTP answer."""

    def __init__(self, message: str, status: int = 400, reason: Refusal = Refusal.INVALID) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


@dataclass
class ReloadPlan:
    argv: list[str]  # the llama-server command as the user would write it, with the changes
    changes: list[str] = field(default_factory=list)
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # config settings it changes, by section


def plan(user_argv: Sequence[str], body: Mapping[str, Any], arity: Mapping[str, bool] | None) -> ReloadPlan:
    """The next argv, or ReloadRefused naming every problem at once."""
    unknown = sorted(set(body) - set(FIELDS))
    problems = [f"unknown field(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})"] if unknown else []
    edit = _Edit(list(user_argv), arity, problems)
    if "n_ctx" in body:
        n_ctx = body["n_ctx"]
        if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0:
            problems.append(f"n_ctx must be a positive integer, not {n_ctx!r}")
        else:
            edit.set(args.CTX_SIZE, str(n_ctx))
    for key, names in (("cache_type_k", args.CACHE_TYPE_K), ("cache_type_v", args.CACHE_TYPE_V)):
        if key in body:
            value = str(body[key]).lower()
            if value not in CACHE_TYPES:
                problems.append(f"{key} must be one of {', '.join(CACHE_TYPES)}, not {body[key]!r}")
            else:
                edit.set(names, value)
    if "swa_full" in body:
        wanted = _flag(body, "swa_full", problems)
        if wanted is not None:
            edit.switch(args.SWA_FULL, wanted)
            edit.plan.settings["slots"] = {"swa_full": "always" if wanted else "never"}
    if "kv_unified" in body:
        unified = _flag(body, "kv_unified", problems)
        if unified is not None:
            edit.switch(args.NO_KV_UNIFIED, False)
            edit.switch(args.KV_UNIFIED, unified)
            if not unified:
                edit.switch(args.NO_KV_UNIFIED, True)
    if "spec" in body:
        _spec(edit, body["spec"])
    if "mmproj" in body:
        _mmproj(edit, body["mmproj"])
    if "args" in body:
        _free_edits(edit, body["args"])
    quantized_v = (args.get(edit.plan.argv, args.CACHE_TYPE_V) or "f16") not in ("f16", "f32", "bf16")
    if quantized_v and (args.get(edit.plan.argv, args.FLASH_ATTN) or "auto").lower() in ("off", "0", "false"):
        problems.append("a quantized V cache needs flash attention, and the argv says -fa off")
    if problems:
        raise ReloadRefused("; ".join(problems))
    if not edit.plan.changes:
        given = [key for key in FIELDS if key in body]
        said = (f"{', '.join(given)} already in force" if given else "give at least one of " + ", ".join(FIELDS))
        raise ReloadRefused("nothing to change: " + said, reason=Refusal.NOTHING_TO_CHANGE)
    return edit.plan


class _Edit:
    def __init__(self, argv: list[str], arity: Mapping[str, bool] | None, problems: list[str]) -> None:
        self.plan = ReloadPlan(argv)
        self.arity = arity
        self.problems = problems

    def known(self, name: str) -> bool:
        if name in PROTECTED:
            self.problems.append(f"{name} cannot be changed by a reload: it is {PROTECTED[name]}")
            return False
        if self.arity is not None and name not in self.arity:
            self.problems.append(f"this llama-server does not know {name} (its --help does not list it)")
            return False
        return True

    def set(self, names: Sequence[str], value: str) -> None:
        if self.known(names[-1] if names[-1].startswith("--") else names[0]):
            old = args.get(self.plan.argv, names)
            if old != value:
                self.plan.argv = args.replace(self.plan.argv, names, value)
                self.plan.changes.append(f"{names[0]} {old or '(unset)'} -> {value}")

    def switch(self, names: Sequence[str], on: bool) -> None:
        present = args.has(self.plan.argv, names)
        if present == on:
            return
        if on and not self.known(names[-1] if names[-1].startswith("--") else names[0]):
            return
        self.plan.argv = args.replace(self.plan.argv, names, None) if on else \
            args.remove(self.plan.argv, names, takes_value=False)
        self.plan.changes.append(f"{names[0]} {'on' if on else 'off'}")

    def drop(self, name: str) -> None:
        """Remove an option whatever its spelling of value, as the binary's --help says it takes one or not."""
        if not args.has(self.plan.argv, (name,)):
            return
        takes_value = bool(self.arity.get(name, True)) if self.arity is not None else True
        self.plan.argv = args.remove(self.plan.argv, (name,), takes_value=takes_value)
        self.plan.changes.append(f"{name} removed")


def _flag(body: Mapping[str, Any], key: str, problems: list[str]) -> bool | None:
    value = body[key]
    if not isinstance(value, bool):
        problems.append(f"{key} must be true or false, not {value!r}")
        return None
    return value


def _spec(edit: _Edit, spec: Any) -> None:
    types = spec.get("types") if isinstance(spec, dict) else None
    if types != ["none"]:
        edit.problems.append('spec: only {"types": ["none"]} (speculative decoding off) can be asked for')
        return
    for arg in list(edit.plan.argv):
        name = arg.partition("=")[0]
        if name.startswith("-") and ("draft" in name or name.startswith("--spec") or name in ("-md",)):
            edit.drop(name)


def _mmproj(edit: _Edit, mmproj: Any) -> None:
    if not isinstance(mmproj, dict) or not set(mmproj) <= {"path", "mmproj_offload"}:
        edit.problems.append('mmproj must be {"path": FILE or "", "mmproj_offload": true|false}')
        return
    if "path" in mmproj:
        path = mmproj["path"]
        if not isinstance(path, str):
            edit.problems.append(f"mmproj.path must be a string, not {path!r}")
        elif path == "":
            for name in _MMPROJ_PATHS:
                edit.drop(name)
        else:
            edit.set(("-mm", "--mmproj"), path)
    if "mmproj_offload" in mmproj:
        offload = _flag(mmproj, "mmproj_offload", edit.problems)
        if offload is not None:
            edit.switch(("--no-mmproj-offload",), not offload)


def _free_edits(edit: _Edit, free: Any) -> None:
    if not isinstance(free, dict) or not set(free) <= {"set", "remove"}:
        edit.problems.append('args must be {"set": {"--flag": "value"}, "remove": ["--flag"]}')
        return
    for name in free.get("remove") or []:
        if isinstance(name, str) and name.startswith("-") and edit.known(name):
            edit.drop(name)
        elif not isinstance(name, str) or not name.startswith("-"):
            edit.problems.append(f"args.remove: {name!r} is not a flag")
    for name, value in (free.get("set") or {}).items():
        if not name.startswith("-"):
            edit.problems.append(f"args.set: {name!r} is not a flag")
        elif value is True or value is None:
            edit.switch((name,), True)
        elif value is False:
            edit.switch((name,), False)
        elif isinstance(value, str | int | float):
            if edit.arity is not None and name in edit.arity and not edit.arity[name]:
                edit.problems.append(f"args.set: {name} is a switch (true or false), not {value!r}")
            else:
                edit.set((name,), str(value))
        else:
            edit.problems.append(f"args.set: the value of {name} must be a string, a number, or true/false")
