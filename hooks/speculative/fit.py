"""The spec built-in's argv: with `spec.when: alone`, the argv's speculative decoding left out while the
built-in has dropped it (the same change as the degradation ladder's `disable-spec`)."""

from __future__ import annotations

from collections.abc import Sequence

from hooks.asks import Draft, asked
from hooks.speculative.settings import switching
from hooks.speculative.state import STATE
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config
from wrapper.configuration.reload_plan import plan
from wrapper.kept import Kept
from wrapper.launching.flags import flag_arity
from wrapper.launching.launch import Asks, Fitting, Launch


def speculates(argv: Sequence[str]) -> bool:
    """Speculative decoding in the argv: a `--spec-type` other than `none` (with its draft model, or an n-gram
    type), or `--spec-default`. A draft model alone (`-md`) drafts nothing: `--spec-type` defaults to none."""
    kind = args.get(argv, ("--spec-type",))
    if kind is not None:
        return kind != "none"
    return args.has(argv, ("--spec-default",))


def drafts_nothing(argv: Sequence[str]) -> bool:
    """A draft model is loaded but `--spec-type` is not given: it costs its memory and drafts nothing."""
    return not speculates(argv) and any(args.has(argv, (flag,)) for flag in args.SPEC if flag != "--spec-type")


def fit(argv: list[str], launch: Launch, config: Config, shared: Kept, asks: Asks) -> Fitting:
    if not switching(config):
        return Fitting(list(argv))
    if not speculates(argv):
        idle = Fitting(list(argv))
        idle.note("nothing (spec.when: alone)", "the argv has no speculative decoding to switch (a draft model "
                  "with --spec-type, or an n-gram --spec-type)")
        return idle
    kept = shared.get(STATE)
    kept.keep(launch.model.id, config.argv)  # this machine's rates for this setup, from an earlier run
    if (draft := asked(asks, Draft)) is not None:
        kept.off = not draft.running
    if not kept.off:
        return Fitting(list(argv), fitted=True)
    without = plan(argv, {"spec": {"types": ["none"]}}, flag_arity(argv[0]))
    done = Fitting(without.argv, fitted=False)
    done.note("speculative decoding left out (" + "; ".join(without.changes) + ")",
              "spec.when: alone: several requests decode at once, or the draft does not pay alone")
    return done


def warnings(config: Config) -> list[str]:
    argv = config.argv
    if not switching(config) or not argv or speculates(argv):
        return []
    if drafts_nothing(argv):
        return ["spec.when: alone, but the draft model is given without --spec-type, which defaults to none: it "
                "drafts nothing; add --spec-type draft-simple (or another type)"]
    return ["spec.when: alone, but the server's argv has no speculative decoding to switch (a draft model with "
            "--spec-type, or an n-gram --spec-type)"]
