"""When a conversation still in its slot is kept again: what it grew by since it was last kept, its answer
included."""

from __future__ import annotations

from hooks.slots import left_in_slot
from hooks.slots.book import SlotBook, grown


def test_a_conversation_never_kept_grew_by_all_it_holds() -> None:
    assert grown(None, list(range(900)), 1200) == 1200  # a 900-token prompt and its 300-token answer


def test_the_next_turn_grew_by_what_it_holds_beyond_what_was_kept() -> None:
    first = list(range(900))
    following = [*first, *range(1000, 1330)]  # the answer and the next question, read again as the prompt
    assert grown((first, 1200), following, 1400) == 200


def test_another_conversation_in_the_slot_grew_from_what_the_two_share() -> None:
    kept = list(range(5000))
    other = [*range(10), *range(9000, 10500)]  # the same system prompt, then something else
    assert grown((kept, 5200), other, 1700) == 1690  # not negative: it is kept once it holds enough of its own


def test_unkept_is_what_each_slot_holds_beyond_what_the_store_keeps() -> None:
    """What a crash now would prefill again (status `unkept_tokens`): nothing for a slot saved since it last grew
    or restored unchanged, all of a conversation never kept, the growth of one kept before."""
    book = SlotBook()
    book.learnt_total(2)
    book.pinned()
    first = list(range(900))
    book.answered(0, 1200, 0)
    book.served(0, first)
    book.restored(1, list(range(5000, 5400)), "e1")
    assert book.unkept() == {0: 1200, 1: 0}
    book.saved(0, list(range(1200)), "e0")
    book.kept(0, first, 1200)
    assert book.unkept() == {0: 0, 1: 0}
    following = [*range(1200), *range(2000, 2100)]
    book.answered(0, 1400, 1200)
    book.served(0, following)
    assert book.unkept() == {0: 200, 1: 0}
    assert book.untracked() == []
    book.forgotten()  # a request the server placed itself: any slot may hold anything now
    assert book.unkept() == {} and book.untracked() == [0, 1]
    book.unkeepable(1)  # a save of it kept nothing: too little to keep
    assert book.untracked() == [0]
    changes = book.changes(1)
    book.served(1, None)  # a request the server placed there
    assert book.untracked() == [0, 1] and book.changes(1) > changes
    book.restored(0, list(range(700)), "e2")  # a start's restore: kept as it stands
    assert book.unkept() == {0: 0}


def test_what_an_answer_leaves_in_its_slot_is_read_from_its_last_timings() -> None:
    whole = b'{"choices": [], "timings": {"cache_n": 30, "prompt_n": 1, "prompt_ms": 50.9, "predicted_n": 3}}'
    assert left_in_slot(whole) == 34
    resumed = b'data: {"timings": {"cache_n": 5, "prompt_n": 2, "predicted_n": 9}}\n\n' \
              b'data: {"timings": {"cache_n": 100, "prompt_n": 20, "predicted_n": 7}}\n\ndata: [DONE]\n\n'
    assert left_in_slot(resumed) == 127
    assert left_in_slot(b'{"error": {"code": 500}}') is None
