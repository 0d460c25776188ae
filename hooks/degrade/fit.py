"""Fitting the child's argv to the memory budget at every start and reload: the chosen rung at its largest
context. What to fit for comes as a parameter (`Wanted`): a growth, relax or budget change asks for a rung and
a budget; without one the rung and budget in force are kept."""

from __future__ import annotations

import os

from hooks.asks import asked
from hooks.degrade.ladder import Planner, RungPlan, choose
from hooks.degrade.memory import PlanError
from hooks.degrade.planning import MIN_START_CTX, cells, ladder_for, pool_device, resolve_budget
from hooks.degrade.pool.folder import Member, Pool
from hooks.degrade.pool.member import ask_now, member_name, pool_of
from hooks.degrade.settings import DEGRADE, DegradeSettings
from hooks.degrade.state import Fitted, state_of
from hooks.degrade.wanted import Wanted
from hooks.media.settings import on_demand
from hooks.slots import noted_tokens
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.units import format_size
from wrapper.kept import Kept
from wrapper.launching.flags import flag_arity
from wrapper.launching.launch import Asks, Fitting, Launch

VERBOSITY = ("-lv", "--verbosity", "--log-verbosity")


class NoRungFits(ConfigError):
    """The budget holds no rung of the ladder; carries the planned rungs for the plan command."""

    def __init__(self, message: str, rungs: list[RungPlan], budget: int, source: str) -> None:
        super().__init__(message)
        self.rungs, self.budget, self.budget_source = rungs, budget, source


def fit(argv: list[str], launch: Launch, config: Config, shared: Kept,
        asks: Asks) -> Fitting:
    """The child's argv for the chosen rung at its largest context under the budget."""
    settings = DEGRADE.of(config)
    state = state_of(shared)
    ask = asked(asks, Wanted) or Wanted()
    out = Fitting(list(argv))
    if launch.model.path is None:
        out.note("degrade: off", "no -m model file to plan with (-hf and URLs are not planned)")
        return out
    pool = pool_of(settings)
    if pool is not None:
        try:
            pooled = _fit_in_pool(pool, argv, launch, config, shared, ask, settings)
        except PlanError as exc:
            out.note("degrade: off", f"cannot plan this model: {exc}")
            return out
        chosen, n_ctx, planner, rungs, budget, source = pooled[:6]
    else:
        if ask.budget is not None:
            budget, source = ask.budget
        elif state.budget is not None:
            budget, source = state.budget, state.budget_source
        else:
            budget, source = resolve_budget(settings, argv)
            state.budget, state.budget_source = budget, source  # the budget a start resolves stays in force
        try:
            planner, rungs = ladder_for(argv, launch, config, state, budget, ask.backend)
        except PlanError as exc:
            out.note("degrade: off", f"cannot plan this model: {exc}")
            return out
        wanted = max(min(planner.ceiling, MIN_START_CTX), _saved_tokens(launch, shared, settings))
        chosen = _fitting(_chosen(rungs, ask.rung or state.rung_in_force, wanted), rungs, budget, source)
        n_ctx = chosen.max_ctx
    before = args.get(argv, args.CTX_SIZE)
    out.argv = args.replace(chosen.argv, args.CTX_SIZE, str(n_ctx))
    flags = flag_arity(argv[0])
    verbosity_added = False
    if not args.has(out.argv, VERBOSITY) and (flags is None or "-lv" in flags):
        out.argv += ["-lv", "4"]
        verbosity_added = True
        out.note("-lv 4", "llama-server prints its buffer sizes only at verbosity 4: the planner learns from them "
                 "(the wrapper logs the extra lines at debug level)")
    planned = chosen.plan if n_ctx == chosen.max_ctx else planner.plan(chosen.argv, n_ctx)
    assert planned is not None
    context = f"-c {before} -> {n_ctx}" if before and before != str(n_ctx) else f"-c {n_ctx}"
    limit = f"the largest context under the budget {format_size(budget)} ({source})"
    if pool is not None:
        limit = (f"what this member needs now, of {format_size(budget)} the pool {pool.dir} has for it (its share "
                 "and what is free)")
    elif planner.ceiling - chosen.max_ctx < 256:  # the ceiling held it, not the budget
        bound = "the model's training context" if planner.ceiling == planner.shape.n_ctx_train else "the -c given"
        limit = f"{bound} ({planner.ceiling}), within the budget {format_size(budget)} ({source})"
    out.note(f"degrade: rung {chosen.name}, {context}",
             f"{limit}; planned {format_size(planned.total(planned.budget_device))} on the {planned.budget_device}")
    swa_dropped = args.has(argv, args.SWA_FULL) and not args.has(out.argv, args.SWA_FULL)
    if swa_dropped:
        out.keep_saved = (f"rung {chosen.name} drops --swa-full: a slot saved now could not be reused, so the slots "
                          "saved with a full sliding-window cache are kept")
    share, floor = (pooled[6], pooled[7]) if pool is not None else (planned.total(planned.budget_device), 0)
    out.fitted = Fitted(chosen.name, rungs.index(chosen), n_ctx, planner.choices(out.argv), rungs,
                        budget, source, swa_dropped, verbosity_added, share, floor,
                        str(pool.dir) if pool is not None else None)
    return out


Pooled = tuple[RungPlan, int, Planner, list[RungPlan], int, str, int, int]


def _fit_in_pool(pool: Pool, argv: list[str], launch: Launch, config: Config, shared: Kept, ask: Wanted,
                 settings: DegradeSettings) -> Pooled:
    """The rung and context this member needs now (not all it could take), planned with what the pool has free
    and taken from it under its lock: two members fitting at once never both count the same bytes. A start
    that does not fit asks the others first (and waits for them here: nothing is served yet)."""
    state = state_of(shared)
    device = pool_device(argv, ask.backend)
    for last in (False, True):
        with pool.locked() as held:
            made = held.made()
            total, source = ((settings.budget, "degrade.budget") if settings.budget is not None
                             else (int(made["total"]), str(made["source"])) if made else resolve_budget(settings, argv))
            held.join(total, source, device, settings.budget is not None)
            free = held.free(os.getpid())
            budget = max(0, min(free, ask.limit) if ask.limit is not None else free)
            planner, rungs = ladder_for(argv, launch, config, state, budget, ask.backend)
            rest = min(planner.ceiling, settings.context or MIN_START_CTX)
            saved = _saved_tokens(launch, shared, settings) if not state.started else 0  # a start restores them
            kept = state.ctx_taken if ask.ctx is None else 0  # a reload degrade did not ask for keeps the context
            wanted = min(planner.ceiling, cells(max(ask.ctx or 0, rest, saved, kept)))
            chosen = _chosen(rungs, ask.rung or state.rung_in_force, wanted)
            short = 0
            if not state.started and not last and choose(rungs, wanted) is None and rungs[0].skipped is None:
                short = planner.plan(rungs[0].argv, wanted).total(device) - budget
            if short <= 0:
                chosen = _fitting(chosen, rungs, budget,
                                  f"what the pool {pool.dir} has for it, of {format_size(total)}")
                n_ctx = min(chosen.max_ctx, wanted)
                share = planner.plan(chosen.argv, n_ctx).total(device)
                floor = _floor(planner, rungs, config, settings)
                held.put(Member(os.getpid(), member_name(launch), share, floor, rung=chosen.name, n_ctx=n_ctx,
                                serving=state.started))  # after its start it answers asks (between reloads too)
                state.started, state.ctx_taken = True, n_ctx
                return chosen, n_ctx, planner, rungs, budget, f"pool {pool.dir} ({source})", share, floor
        ask_now(pool, Member(os.getpid(), member_name(launch), 0), short, settings.pool_wait)
    raise AssertionError("the second pass always returns")


def _floor(planner: Planner, rungs: list[RungPlan], config: Config, settings: DegradeSettings) -> int:
    """The least this member could run with: its cheapest rung at its smallest context, without a projector
    that media would give up."""
    smallest = min(planner.ceiling, settings.context or MIN_START_CTX, MIN_START_CTX)
    usable = [r for r in rungs if r.skipped is None]
    if not usable:
        return 0
    argv = usable[-1].argv
    if on_demand(config):
        argv = args.remove(argv, args.MMPROJ)
    found = planner.plan(argv, smallest)
    return found.total(found.budget_device)


def _fitting(chosen: RungPlan | None, rungs: list[RungPlan], budget: int, source: str) -> RungPlan:
    """The rung chosen; NoRungFits when none was."""
    if chosen is None:
        smallest = min((r.plan.total(r.plan.budget_device) for r in rungs if r.plan), default=0)
        raise NoRungFits(f"degrade.budget {format_size(budget)} ({source}) holds no rung of the ladder: the smallest "
                         f"needs {format_size(smallest)} at 256 tokens of context; raise the budget or use a smaller "
                         "model", rungs, budget, source)
    return chosen


def _chosen(rungs: list[RungPlan], named: str | None, wanted: int) -> RungPlan | None:
    """The rung asked for (or held since a move); else the best one whose context reaches `wanted`, else the one
    with the largest context."""
    if named is not None:
        found = next((r for r in rungs if r.name == named and r.skipped is None and r.max_ctx), None)
        if found is not None:
            return found
    usable = [r for r in rungs if r.skipped is None and r.max_ctx > 0]
    return choose(rungs, wanted) or (max(usable, key=lambda r: r.max_ctx) if usable else None)


def _saved_tokens(launch: Launch, shared: Kept, settings: DegradeSettings) -> int:
    """The longest conversation this host's slots held at its last stop, plus headroom: a start should be able to
    restore it (one only the bucket holds too: `slots.restore` fetches it)."""
    tokens = noted_tokens(launch, shared)
    return max(tokens) + settings.headroom if tokens else 0


