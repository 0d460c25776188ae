"""The degradation ladder: rung 0 is the command line as given; each further rung gives up one more thing
(speculative decoding, the mmproj on the GPU, K/V precision, the full sliding-window cache, or the user's own
argv edits) and so fits a larger context under the same memory budget.

Rungs are cumulative. A rung that cannot apply (nothing to give up, below the user's own cache type, the binary
lacks a flag) is skipped with a note. Each rung's context is the largest under the budget, capped by the
model's training context and by the user's `-c` when given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hooks.degrade.memory import Choices, ModelShape, Plan, choices_of, largest_ctx, plan
from hooks.degrade.settings import Rung
from wrapper.configuration import argv as args
from wrapper.configuration.reload_plan import ReloadRefused
from wrapper.configuration.reload_plan import plan as edit_argv

_PRECISION = {"f32": 4, "f16": 3, "bf16": 3, "q8_0": 2, "q5_1": 2, "q5_0": 2, "q4_1": 1, "q4_0": 1, "iq4_nl": 1}


@dataclass
class RungPlan:
    name: str
    argv: list[str]
    max_ctx: int = 0
    plan: Plan | None = None  # at max_ctx
    changes: list[str] = field(default_factory=list)
    skipped: str | None = None  # why this rung does not apply

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "max_ctx": self.max_ctx}
        if self.skipped:
            out["skipped"] = self.skipped
        else:
            out["changes"] = self.changes
            out["bytes"] = self.plan.as_dict()["bytes"] if self.plan else None
            out["measured"] = sorted(self.plan.measured) if self.plan else []
        return out


@dataclass(frozen=True)
class Planner:
    """Everything a rung's plan needs besides its argv."""

    shape: ModelShape
    gpu: bool
    budget: int
    ceiling: int
    mmproj_bytes: Callable[[Choices], int] = lambda s: 0
    draft: Callable[[Choices], ModelShape | None] = lambda s: None
    calibrate: Callable[[Plan, Choices], Plan] | None = None

    def choices(self, argv: Sequence[str]) -> Choices:
        return choices_of(argv, self.shape, self.gpu)

    def plan(self, argv: Sequence[str], n_ctx: int | None = None) -> Plan:
        s = self.choices(argv)
        if n_ctx is not None:
            s = replace(s, n_ctx=n_ctx)
        result = plan(self.shape, s, self.mmproj_bytes(s), self.draft(s))
        return self.calibrate(result, s) if self.calibrate is not None else result

    def largest(self, argv: Sequence[str]) -> int:
        s = self.choices(argv)
        return largest_ctx(self.shape, s, self.budget, self.ceiling, self.mmproj_bytes(s), self.draft(s),
                           self.calibrate)


def build(argv: Sequence[str], ladder: Sequence[Rung], planner: Planner, arity: Mapping[str, bool] | None,
          user_argv: Sequence[str], is_swa: bool) -> list[RungPlan]:
    """Rung 0 (`argv` as given) and each rung of `ladder` applied on top of the previous one."""
    rungs = [RungPlan("as-given", list(argv))]
    current = list(argv)
    for rung in ladder:
        body, why_not = _body(rung, current, user_argv, planner.gpu, is_swa)
        if body is None:
            rungs.append(RungPlan(rung.name, current, skipped=why_not))
            continue
        try:
            edited = edit_argv(current, body, arity)
        except ReloadRefused as exc:
            rungs.append(RungPlan(rung.name, current, skipped=str(exc)))
            continue
        current = edited.argv
        rungs.append(RungPlan(rung.name, current, changes=edited.changes))
    for rung_plan in rungs:
        if rung_plan.skipped is None:
            rung_plan.max_ctx = planner.largest(rung_plan.argv)
            rung_plan.plan = planner.plan(rung_plan.argv, rung_plan.max_ctx or 256)
    return rungs


def _body(rung: Rung, argv: Sequence[str], user_argv: Sequence[str], gpu: bool,
          is_swa: bool) -> tuple[dict[str, Any] | None, str]:
    if rung.name == "disable-spec":
        if not any(args.has(argv, (flag,)) for flag in args.SPEC):
            return None, "no draft model or speculative decoding to turn off"
        return {"spec": {"types": ["none"]}}, ""
    if rung.name == "mmproj-to-cpu":
        if not args.has(argv, args.MMPROJ):
            return None, "no mmproj"
        if args.has(argv, ("--no-mmproj-offload",)) or not gpu:
            return None, "the mmproj is on the CPU already"
        return {"mmproj": {"mmproj_offload": False}}, ""
    if rung.name in ("quantize-kv-q8", "quantize-kv-q4"):
        target = "q8_0" if rung.name.endswith("q8") else "q4_0"
        floor = [args.get(user_argv, names) for names in (args.CACHE_TYPE_K, args.CACHE_TYPE_V)]
        if any(floor):
            return None, f"you chose the cache types ({'/'.join(t or 'f16' for t in floor)}): they are the floor"
        types = [(args.get(argv, names) or "f16").lower() for names in (args.CACHE_TYPE_K, args.CACHE_TYPE_V)]
        if all(_PRECISION.get(t, 3) <= _PRECISION[target] for t in types):
            return None, f"the K/V cache is {'/'.join(types)} already"
        return {"cache_type_k": target, "cache_type_v": target}, ""
    if rung.name == "swa-window":
        if not is_swa:
            return None, "not a sliding-window model"
        if not args.has(argv, args.SWA_FULL):
            return None, "no --swa-full to drop"
        return {"swa_full": False}, ""
    return {"args": {"set": dict(rung.set), "remove": list(rung.remove)}}, ""


def choose(rungs: Sequence[RungPlan], needed: int, floor: int = 0) -> RungPlan | None:
    """The best (first) usable rung from index `floor` whose largest context holds `needed` tokens."""
    for rung in rungs[floor:]:
        if rung.skipped is None and rung.max_ctx >= needed and rung.max_ctx > 0:
            return rung
    return None
