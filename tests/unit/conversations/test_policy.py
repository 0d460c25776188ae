"""The conversation cache's rule, alone: which slot a request goes to, and restore or prefill."""

from __future__ import annotations

import pytest

from hooks.conversations.policy import (
    ASSUMED_RESTORE_BPS,
    UNTOLD,
    Candidate,
    Rule,
    choose_slot,
    decide,
    dropped,
    placed_in,
    within_slot_shares,
)
from hooks.conversations.rates import Rates

RULE = Rule(min_tokens=256, margin=1.2)
MEASURED = Rates(prefill_tps=2000.0, restore_bps=2e9, convert_bps=2e8)
MB = 1_000_000


@pytest.mark.parametrize(("case", "candidate", "rates", "rule", "restore", "why"), [
    ("no rates yet", Candidate(3000, 0, 300 * MB), Rates(), RULE, True,
     "wins 3000 tokens (no prefill rate measured yet)"),
    ("no rates yet, too little to win", Candidate(200, 0, 1 * MB), Rates(), RULE, False,
     "only 200 tokens to win (cache.min_tokens 256)"),
    ("a tiny gain over what the slot holds", Candidate(3000, 2900, 300 * MB), MEASURED, RULE, False,
     "only 100 tokens to win (cache.min_tokens 256)"),
    ("a quick restore", Candidate(3000, 0, 300 * MB), MEASURED, RULE, True, "wins 3000 tokens"),  # 0.15 s < 1.5 s
    ("a slow restore", Candidate(3000, 0, 300 * MB), MEASURED, Rule(256, 1.2, restore_bps=100 * MB), False,
     "a prefill is quicker"),  # 3 s against 1.5 s
    ("a conversion to pay first", Candidate(3000, 0, 300 * MB, convert=True), MEASURED, RULE, False,
     "a prefill is quicker"),  # 1.5 s + 0.15 s, times 1.2, against 1.5 s
    ("a small conversion that still pays", Candidate(3000, 0, 100 * MB, convert=True), MEASURED, RULE, True,
     "wins 3000 tokens"),
    ("a slow remote fetch", Candidate(3000, 0, 300 * MB, fetch_s=4.0), MEASURED, RULE, False,
     "a prefill is quicker"),
    ("a quick remote fetch", Candidate(30000, 0, 300 * MB, fetch_s=1.0), MEASURED, RULE, True, "wins 30000 tokens"),
    ("nothing cached", None, MEASURED, RULE, False, "not cached"),
    ("the slot holds as much", Candidate(3000, 3000, 300 * MB), MEASURED, RULE, False, "the slot holds as much"),
    ("a template's first tokens", Candidate(6, 6, 300 * MB), MEASURED, RULE, False, "not cached"),
])
def test_restore_or_prefill(case: str, candidate: Candidate | None, rates: Rates, rule: Rule, restore: bool,
                            why: str) -> None:
    decision = decide(candidate, rates, rule)
    assert (decision.restore, decision.why) == (restore, why), case
    assert (decision.miss is None) is restore  # a prefill is counted among the misses, with its reason


def test_the_predictions_say_what_the_choice_weighed() -> None:
    decision = decide(Candidate(3000, 1000, 300 * MB, convert=True, fetch_s=0.5), MEASURED, RULE)
    assert decision.gain == 2000 and decision.prefill_s == pytest.approx(1.0)
    assert decision.restore_s == pytest.approx(0.5 + 1.5 + 0.15)
    unmeasured = decide(Candidate(3000, 0, 300 * MB), Rates(), RULE)
    assert unmeasured.prefill_s is None and unmeasured.restore_s == pytest.approx(300 * MB / ASSUMED_RESTORE_BPS)


Q, A = list(range(300)), list(range(1000, 1500))  # a question and the answer that followed it


@pytest.mark.parametrize(("case", "held", "tokens", "chosen"), [
    ("a regenerate: the question without its answer", {0: Q + A}, Q, 0),
    ("the next turn of the conversation", {0: [9] * 40, 1: Q + A}, Q + A + [7], 1),
    ("the longest prefix wins", {0: Q[:280], 1: Q + A}, [*Q, 5], 1),
    ("a chat template's first tokens are not a conversation", {0: Q[:10] + A}, Q[:10] + [5] * 400, 1),
    ("a short conversation shared by half", {0: Q[:100]}, Q[:60] + [5] * 100, 0),
    ("else the cheapest to move out", {0: Q + A, 1: A}, [5] * 400, 1),
])
def test_the_slot_of_a_request(case: str, held: dict[int, list[int]], tokens: list[int], chosen: int) -> None:
    assert choose_slot([0, 1], held, tokens, {}, 256) == chosen, case


def test_among_empty_or_equal_slots_the_least_recently_used() -> None:
    assert choose_slot([0, 1, 2], {0: A, 1: A, 2: A}, [5] * 400, {0: 30.0, 1: 10.0, 2: 20.0}, 256) == 1


@pytest.mark.parametrize(("known", "count", "tokens", "dropped_n"), [
    ([1, 2, 3], 3, [1, 2, 3, 4], 0),  # it goes on with all of it
    ([1, 2, 3], 3, [1, 2, 9], 1),  # it keeps what it shares
    (list(range(44)), 344, [*range(44), *range(100, 400), 7], 0),  # the next turn: the answer comes back
    (list(range(44)), 344, [*range(24), 9, 9], 320),  # another conversation shares its template's first tokens
    (list(range(44)), 344, [*range(44), 5], 300),  # shorter than what the slot holds: the answer is dropped
    ([], 0, [1, 2], 0),
    ([], 120, [1, 2], 120),  # held, not known token by token (a continued turn whose template differed)
    ([], 120, list(range(200)), 120),  # nothing known: nothing is taken to go on
])
def test_what_a_request_that_takes_a_slot_drops(known: list[int], count: int, tokens: list[int],
                                                dropped_n: int) -> None:
    assert dropped(known, count, tokens) == dropped_n


def test_a_slot_a_server_placed_request_ran_in_is_taken_last() -> None:
    """Its tokens are not known (it looks empty) but it holds something, saved before a conversation takes it."""
    held = {1: A}
    assert choose_slot([0, 1], held, [5] * 400, {}, 256, unknown={0}) == 1
    assert choose_slot([0, 1], held, [5] * 400, {}, 256) == 0  # as an empty slot otherwise
    assert choose_slot([0, 1], {}, [5] * 400, {0: 1.0, 1: 2.0}, 256, unknown={0, 1}) == 0


def test_a_chat_templates_first_tokens_do_not_move_an_agent_into_a_persons_slot() -> None:
    """A person's short question and an agent's task share the template's system prompt: more than half of the
    question's slot, but it counts only on a slot of the agent's own class (or when the agent goes on from all of
    it); a long shared prefix counts anywhere."""
    question, task = [*range(30), 900, 901, 902], [*range(30), 700, 701, 702, 703]
    held = {0: question}
    assert choose_slot([0, 1], held, task, {}, 256) == 0  # the class not told: as before
    assert choose_slot([0, 1], held, task, {}, 256, ours={1}) == 1  # slot 0 last served a person
    assert choose_slot([0, 1], held, task, {}, 256, ours={0}) == 0
    assert choose_slot([0, 1], held, [*question, 5], {}, 256, ours={1}) == 0  # it goes on from all of it
    assert choose_slot([0, 1], {0: list(range(300))}, [*range(300), 1], {}, 256, ours=set()) == 0


def test_a_slot_whose_class_is_not_known_counts_for_either() -> None:
    """Restored at a start, a slot's last request is not known: a short conversation there still goes on in it."""
    held = {0: [*range(30), 900, 901]}
    assert choose_slot([0, 1], held, [*range(30), 900, 5], {}, 256, ours={0, 1}) == 0


def test_another_consumers_slot_gives_only_the_public_beginning() -> None:
    """Under consumers.isolate the slot holding another's conversation counts as holding what the request shares
    with the public beginning: the copy of that conversation goes to an empty slot, not into it."""
    theirs = list(range(600))
    assert choose_slot([0, 1], {0: theirs}, theirs, {}, 256) == 0  # one pool: the longest prefix
    assert choose_slot([0, 1], {0: theirs}, theirs, {}, 256, reach={0: 20}) == 1
    assert choose_slot([0], {0: theirs}, theirs, {}, 256, reach={0: 20}) == 0  # the only one: it is cut first
    short = list(range(30))  # a short question of another's: its public 20 tokens are more than half of it
    assert choose_slot([0, 1], {0: short}, [*short[:20], 7, 8], {}, 256, reach={0: 20}) == 1
    assert choose_slot([0, 1], {0: theirs}, theirs, {}, 256, reach={0: 300}) == 0  # a long public beginning


def test_a_consumer_at_its_slot_share_takes_its_own_and_one_within_its_share_keeps_its_slot() -> None:
    owners = {0: "agent", 1: "alice", 2: None}
    shares = {"agent": 1, "alice": 1}
    assert within_slot_shares([0, 1, 2], owners, "agent", shares) == ([0], set())  # its one slot is free: that one
    assert within_slot_shares([1, 2], owners, "agent", shares) == ([1, 2], {1})  # busy: alice's is taken last
    assert within_slot_shares([0, 1, 2], owners, "bob", {}) == ([0, 1, 2], set())
    held = {0: list(range(10)), 1: list(range(5))}
    assert choose_slot([0, 1], held, [7] * 400, {}, 256, last={1}) == 0  # the longer one, alice's kept


def test_a_consumers_salts_count_together_and_a_front_ends_users_each_within_its_share() -> None:
    """`cache_salt`: alice's conversations of two salts are both hers for her share; `by_header`: a share given to
    the front-end bounds each of its users on its own."""
    owners = {0: "alice#1111", 1: "alice#2222", 2: "open-webui/u1", 3: None}
    shares = {"alice": 2, "open-webui": 1}
    assert within_slot_shares([0, 1, 3], owners, "alice#3333", shares) == ([0, 1], set())  # at hers: her own
    assert within_slot_shares([2, 3], owners, "open-webui/u1", shares) == ([2], set())  # u1 at its share
    assert within_slot_shares([2, 3], owners, "open-webui/u2", shares) == ([2, 3], {2})  # u2 is not: u1's kept last


@pytest.mark.parametrize(("processing", "known", "seen"), [
    ({1}, set(), 1),  # the one slot that processes
    ({0, 1}, {0}, 1),  # slot 0 runs a request the wrapper pinned
    (set(), set(), None),  # not started yet: look again
    ({0}, {0}, None),
    ({0, 2}, set(), UNTOLD),  # two at once: which is whose cannot be told
])
def test_where_a_request_the_server_placed_itself_runs(processing: set[int], known: set[int], seen: int | None) -> None:
    assert placed_in(processing, known) == seen
