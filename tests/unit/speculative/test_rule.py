"""The draft rule as a table: alone or in a crowd, with what was measured or given, and the reload's cost."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hooks.speculative.fit import speculates
from hooks.speculative.rule import Rates, decide
from hooks.speculative.state import SpecState, Track
from wrapper import built_ins

TABLE = [
    # case, crowd, running, rates, given, reload_s, (draft, switch), reason starts with
    ("alone, nothing measured without it: as configured", False, True, Rates(alone_with=46), None, 0.1,
     (True, False), "alone, nothing measured"),
    ("a crowd, nothing measured there: assumed not to pay", True, True, Rates(alone_with=46), None, 0.1,
     (False, True), "in a crowd the draft does not pay: 0.75x (assumed"),
    ("a crowd measured to pay keeps it", True, True, Rates(crowd_with=90, crowd_without=60), None, 0.1,
     (True, False), "in a crowd the draft pays: 1.50x (measured"),
    ("alone again after a crowd, nothing measured without: off until measured", False, False, Rates(alone_with=46),
     None, 0.1, (False, False), "alone, the draft off: kept off until"),
    ("off after a crowd, measured alone without it only: on once, to measure it", False, False,
     Rates(alone_without=25.52, crowd_with=20, crowd_without=30), None, 0.1, (True, True),
     "alone, measured without the draft only"),
    ("off, and nothing measured with it either: as configured", False, False, Rates(), None, 0.1,
     (True, True), "alone, nothing measured"),
    ("alone, measured not to pay alone either: stays off", False, False, Rates(alone_with=46, alone_without=122),
     None, 0.1, (False, False), "alone the draft does not pay: 0.38x (measured alone)"),
    ("alone, measured not to pay: turned off", False, True, Rates(alone_with=46, alone_without=122), None, 0.1,
     (False, True), "alone the draft does not pay"),
    ("alone, given a speedup that pays: back on", False, False, Rates(alone_with=46, alone_without=122), 2.0, 0.1,
     (True, True), "alone the draft pays: 2.00x (spec.alone_speedup)"),
    ("a switch that wins less than its reload costs is not made", True, True, Rates(), None, 30.0,
     (True, False), "in a crowd the draft does not pay: 0.75x (assumed in a crowd until measured (llama.cpp "
                    "#27342)), but a switch wins"),
]


@pytest.mark.parametrize(("case", "crowd", "running", "rates", "given", "reload_s", "expected", "reason"), TABLE,
                         ids=[row[0] for row in TABLE])
def test_the_rule(case: str, crowd: bool, running: bool, rates: Rates, given: float | None, reload_s: float,
                  expected: tuple[bool, bool], reason: str) -> None:
    decision = decide(crowd, running, rates, 30.0, reload_s, given)
    assert (decision.draft, decision.switch) == expected, decision
    assert decision.reason.startswith(reason), decision.reason
    assert decision.figures["crowd"] is crowd and decision.figures["reload_s"] == reload_s


def test_rates_are_aggregates_of_the_requests_decoding_at_once() -> None:
    kept = SpecState()
    one, two = Track(draft=True), Track(draft=True)
    kept.began(one)
    assert kept.crowd_since is None
    kept.began(two)
    assert kept.crowd_since is not None and one.most == two.most == 2
    one.per_second, one.predicted = 30.0, 50
    kept.ended(one)
    assert kept.crowd_since is None and kept.rates == {"crowd_with": 60.0}
    kept.ended(two)  # no timings: not measured
    alone = Track(draft=False)
    kept.began(alone)
    alone.per_second, alone.predicted = 120.0, 50
    kept.ended(alone)
    assert kept.rates == {"crowd_with": 60.0, "alone_without": 120.0}
    assert kept.measured() == Rates(crowd_with=60.0, alone_without=120.0)


@pytest.mark.parametrize(("argv", "drafting"), [
    (["-m", "m", "-md", "d", "--spec-type", "draft-simple"], True),
    (["-m", "m", "--spec-type", "ngram-mod"], True),
    (["-m", "m", "--spec-default"], True),
    (["-m", "m", "-md", "d"], False),  # --spec-type defaults to none: the draft model drafts nothing
    (["-m", "m", "-md", "d", "--spec-type", "none"], False),
    (["-m", "m"], False),
])
def test_what_counts_as_speculative_decoding(argv: list[str], drafting: bool) -> None:
    assert speculates(argv) is drafting


def test_check_warns_of_a_draft_that_drafts_nothing() -> None:
    config = built_ins.parse("spec: {when: alone}\n")
    (warning,) = built_ins.warnings(replace(config, argv=("llama-server", "-m", "m", "-md", "d")))
    assert "drafts nothing" in warning and "--spec-type draft-simple" in warning
    (nothing,) = built_ins.warnings(replace(config, argv=("llama-server", "-m", "m")))
    assert "no speculative decoding to switch" in nothing


def test_the_rates_are_kept_per_model_and_setup_across_a_restart(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = ("llama-server", "-m", "m", "-md", "d", "--spec-type", "draft-simple", "-np", "3")
    first = SpecState()
    first.keep("m1", argv)
    alone = Track(draft=True)
    first.began(alone)
    alone.per_second, alone.predicted = 80.0, 32
    first.ended(alone)
    again = SpecState()
    again.keep("m1", argv)
    assert again.rates == {"alone_with": 80.0}
    other = SpecState()
    other.keep("m1", (*argv[:-1], "1"))  # another -np: another setup, its own rates
    assert other.rates == {}
