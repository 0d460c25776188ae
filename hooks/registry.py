"""Every built-in, declared in one place: its settings section, its actions, what it adds to the child's argv,
its steps on the request path, what it watches in proxied responses, what it reports in status, and what it
does when a generation is replaced. Its `llama-wrapper` subcommands are named in hooks/commands.py.

The wrapper reads this table through wrapper/built_ins.py and nowhere else; the built-ins use only the
wrapper's core modules (the layers are declared in pyproject.toml and checked by `make lint`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from hooks import conversations, media, speculative
from hooks.conversations import forget, listing
from hooks.conversations.settings import CACHE
from hooks.degrade import FAMILY as DEGRADE_FAMILY
from hooks.degrade import TURN_ON, control, fit, report
from hooks.degrade.settings import DEGRADE
from hooks.media import fit as media_fit
from hooks.media import idle as media_idle
from hooks.media import report as media_report
from hooks.media import step as media_step
from hooks.media.settings import MEDIA
from hooks.media.state import configured as media_configured
from hooks.server import reload as server_reload
from hooks.slots import actions as slot_actions
from hooks.slots import settings as slot_settings
from hooks.slots.fit import fit_for_slots
from hooks.speculative import control as spec_control
from hooks.speculative import fit as spec_fit
from hooks.speculative import report as spec_report
from hooks.speculative import settings as spec_settings
from hooks.speculative import track as spec_track
from hooks.speculative.settings import SPEC
from hooks.store.checked import checked as store_checked
from hooks.store.settings import STORE, store_warnings
from wrapper import paths
from wrapper.configuration.config import Config
from wrapper.configuration.settings import Section
from wrapper.kept import Kept
from wrapper.launching.launch import Asks, Fitting, Launch
from wrapper.server.generation import Generation, Host
from wrapper.steps import Before, Growth, Observer, Shown

Options = Mapping[str, Any]
ActionFn = Callable[[Generation, Options], Awaitable[str | None]]
Fit = Callable[[list[str], Launch, Config, Kept, Asks], Fitting]


def _no_options(options: Options) -> list[str]:
    return [f"takes no options (got {', '.join(options)})"] if options else []


@dataclass(frozen=True)
class BuiltinAction:
    run: ActionFn
    check: Callable[[Options], list[str]] = _no_options  # problems with its `with:` options, at load
    doc: str = ""


@dataclass(frozen=True)
class Route:
    """An endpoint a built-in adds: `POST` ones need the admin token, `GET` ones one of the API keys."""

    method: str
    path: str
    handler: Callable[[Host, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
    off: str = ""  # how to turn it on, for the 409 it answers while its built-in is not in use
    per_consumer: bool = False  # asked with a consumer's own key (of its own), or the admin token and ?consumer=


@dataclass(frozen=True, kw_only=True)
class Builtin:
    """One built-in: its family and the hook points it fills, each by name (every one but `family` optional).

    When each runs, written once (wrapper/built_ins.py asks only the built-ins in use):
      at load         `sections` read and checked; `actions` named by hooks checked with their `with:` options
      in use          `in_use(config)`, else a hook names one of its actions; settled once per generation;
                      `warnings(config)` printed by `check` and logged at a start (`config.warning`)
      before a start  `fit`: the child's argv, after the fits of the families named in `after`
      a request       `before` steps (after those of `after`), then `observer` watches the response; `growth`
                      when llama-server answers a context overflow; `shown` rewrites what a GET of /props or
                      /v1/models answers
      ready to stop   `background` runs from ready until the stop; `server_line` sees each output line
      a reload        `hand_over` on the old generation before it stops, `take_over` on the new one before it
                      serves, `reload_report` in the reload's answer
      a pause         `keeps_paused`: a step gave the request a `keep` (what its slot holds goes to the store)
      a sleep         `sleep(generation, True)` once llama-server stopped to sleep, `(generation, False)` before
                      the fit of the wake
      when asked      `status` in /wrapper/status, `metrics` before a scrape of /metrics, `routes` as endpoints;
                      `held`: the tokens the slots hold (the KV gauge a router reads)
    """

    family: str  # actions are named `<family>.<verb>`
    after: tuple[str, ...] = ()  # families whose fit and steps run before this one's (the only order there is)
    sections: tuple[Section[Any], ...] = ()  # its sections of the config, each declared in its own module
    actions: Mapping[str, BuiltinAction] = field(default_factory=dict)
    in_use: Callable[[Config], bool] | None = None
    warnings: Callable[[Config], list[str]] | None = None  # what works but is probably not meant
    fit: Fit | None = None  # `asks`: what a move of a built-in asks the next fit for
    before: tuple[Before, ...] = ()
    growth: Growth | None = None
    shown: Shown | None = None
    observer: Callable[[Generation], Observer | None] | None = None
    status: Callable[[Generation], dict[str, Any]] | None = None
    metrics: Callable[[Generation], None] | None = None
    held: Callable[[Generation, Mapping[int, int]], int] | None = None
    hand_over: Callable[[Generation], Awaitable[str]] | None = None
    take_over: Callable[[Generation], Awaitable[str]] | None = None
    reload_report: Callable[[Generation], list[dict[str, Any]]] | None = None  # per slot
    server_line: Callable[[Generation, str], bool] | None = None  # False: log the line at debug level only
    background: Callable[[Host], Coroutine[Any, Any, None]] | None = None
    routes: tuple[Route, ...] = ()
    sleep: Callable[[Generation, bool], None] | None = None
    keeps_paused: bool = False  # its steps keep what a paused request's slot holds (Outgoing.keep): preemption
    families: tuple[str, ...] = ()  # the beginnings of its metric families' names: left out of /metrics while
    # it is not in use, and those `families_off` names while it is
    families_off: Callable[[Config], tuple[str, ...]] | None = None
    checked: Callable[[Config, bool], dict[str, Any] | None] | None = None  # what `check` says of what the
    # config names outside (True: `--probe`, try it)


def ordered(builtins: tuple[Builtin, ...]) -> tuple[Builtin, ...]:
    """The built-ins in the order their `after` declares; where it declares none, by family name (never by where
    one is written). ValueError for an unknown family or a cycle."""
    families = {b.family for b in builtins}
    for builtin in builtins:
        if unknown := set(builtin.after) - families:
            raise ValueError(f"built-in {builtin.family!r} runs after unknown {', '.join(sorted(unknown))}")
    placed: list[Builtin] = []
    waiting = sorted(builtins, key=lambda b: b.family)
    while waiting:
        done = {b.family for b in placed}
        ready = next((b for b in waiting if done.issuperset(b.after)), None)
        if ready is None:
            raise ValueError(f"built-ins run after each other in a cycle: {', '.join(b.family for b in waiting)}")
        placed.append(ready)
        waiting.remove(ready)
    return tuple(placed)


BUILTINS: tuple[Builtin, ...] = ordered((
    Builtin(
        family=slot_settings.FAMILY, sections=(slot_settings.SLOTS, STORE),
        actions={"slots.save": BuiltinAction(lambda g, _: slot_actions.save(g),
                                             doc="save every slot that holds tokens"),
                 "slots.restore": BuiltinAction(lambda g, _: slot_actions.restore(g, conversations.in_use(g.config)),
                                                doc="restore the saved slots the server can use")},
        fit=lambda argv, launch, config, shared, _: fit_for_slots(argv, launch, config, shared),
        observer=slot_actions.observer,
        # the conversation cache's status where it has always been: inside the slot built-ins'
        status=lambda g: {**slot_actions.status(g), "conversations": conversations.status(g)},
        hand_over=slot_actions.save_step, take_over=lambda g: slot_actions.take_over(g, conversations.in_use(g.config)),
        reload_report=slot_actions.restore_report, background=slot_actions.background, metrics=slot_actions.metrics,
        held=slot_actions.held,
        checked=lambda config, probe: {"store": found} if (found := store_checked(config, probe)) else None,
        warnings=store_warnings,
        families=("llama_wrapper_slot_", "llama_wrapper_reused_tokens", "llama_wrapper_store_"),
        families_off=lambda config: () if STORE.of(config).url else ("llama_wrapper_store_",),
    ),
    Builtin(  # on always: without a projector a media request is its 400; the projector on demand
        family=media.FAMILY, sections=(MEDIA,), in_use=lambda config: True, warnings=media_fit.warnings,
        fit=media_fit.fit,
        before=(Before(paths.CARRYING_MEDIA, media_step.before),),
        shown=Shown(paths.DESCRIBING, media_report.applies, media_report.shown),
        status=media_report.status, metrics=media_report.metrics, background=media_idle.drop_when_idle,
        families=("llama_wrapper_projector_",),
        families_off=lambda config: () if media_configured(config) else ("llama_wrapper_projector_",),
    ),
    Builtin(  # with spec.when: alone
        family=speculative.FAMILY, sections=(SPEC,), in_use=spec_settings.switching, warnings=spec_fit.warnings,
        fit=spec_fit.fit,
        before=(Before(paths.DECODING, spec_track.before),), observer=spec_track.observer,
        status=spec_report.status, metrics=spec_report.metrics, background=spec_control.switch_when_calm,
        families=("llama_wrapper_spec_",),
    ),
    Builtin(  # the conversation cache: on with the slot built-ins; after them (it reads what they restored) and
        # after media (a conversation with an image comes back into a server with the projector)
        family=conversations.FAMILY, after=(slot_settings.FAMILY, media.FAMILY), sections=(CACHE,),
        in_use=conversations.in_use,
        before=(Before(conversations.PATHS, conversations.before),
                Before(paths.SLOT_USERS_UNPINNED, conversations.unpinned)),
        observer=conversations.observer, metrics=conversations.metrics, background=conversations.keep_while_idle,
        server_line=conversations.server_line,
        keeps_paused=True, families=("llama_wrapper_conversation_cache_",),
        routes=(Route("DELETE", "/wrapper/conversations", forget.forget,
                      "the conversation cache comes with the slot built-ins (on_startup: "
                      "[{builtin: slots.restore}])", per_consumer=True),
                Route("GET", "/wrapper/conversations", listing.listing,
                      "the conversation cache comes with the slot built-ins (on_startup: "
                      "[{builtin: slots.restore}])", per_consumer=True)),
    ),
    Builtin(
        family="server",
        actions={"server.reload": BuiltinAction(server_reload.run, server_reload.check,
                                                doc="reconfigure a wrapper's llama-server (POST /wrapper/reload)")},
    ),
    Builtin(  # its fit starts from the argv the slot built-ins made fit for persistence, and counts the projector
        # only while media's fit keeps it
        family=DEGRADE_FAMILY, after=(slot_settings.FAMILY, media.FAMILY, speculative.FAMILY), sections=(DEGRADE,),
        in_use=lambda config: DEGRADE.on(config) is not None,
        fit=fit.fit, observer=report.observer, status=report.status, metrics=report.metrics,
        server_line=report.server_line,
        background=control.background, sleep=control.slept,
        growth=Growth(control.grow, lambda config: DEGRADE.of(config).continue_truncated,
                      lambda config: DEGRADE.of(config).headroom),
        routes=(Route("GET", "/wrapper/memory", report.memory_route, TURN_ON),
                Route("POST", "/wrapper/budget", control.set_budget, TURN_ON)),
        families=("llama_wrapper_degrade_", "llama_wrapper_pool_"),
        families_off=lambda config: () if DEGRADE.of(config).pool is not None else ("llama_wrapper_pool_",),
    ),
))
def why_not_kept(config: Config) -> str:
    """Why no built-in keeps what a paused generation's slot holds (preemption needs the conversation cache)."""
    if not config.uses(slot_settings.FAMILY):
        return ("preemption needs the conversation cache, which comes with the slot built-ins: name them in your "
                "hooks (on_startup: [{builtin: slots.restore}], on_will_stop: [{builtin: slots.save}])")
    return "preemption needs the conversation cache, and cache.enabled is false"


ACTIONS: dict[str, BuiltinAction] = {name: action for b in BUILTINS for name, action in b.actions.items()}
SECTIONS: tuple[Section[Any], ...] = tuple(section for b in BUILTINS for section in b.sections)
