"""What each slot holds, one owner: a slot is unchanged only while the store holds exactly what it holds."""

from __future__ import annotations

from hooks.slots.book import SlotBook


def test_a_slot_is_unchanged_from_its_save_or_restore_until_it_serves() -> None:
    book = SlotBook()
    book.learnt_total(2)
    book.pinned()
    book.restored(0, [1, 2, 3], "k0")
    book.saved(1, [4, 5], "k1")
    assert (book.entry_of(0), book.entry_of(1)) == ("k0", "k1")
    book.served(0, [1, 2, 3, 4])
    assert book.entry_of(0) is None and book.holds(0) == [1, 2, 3, 4]  # the next save writes it
    book.served(1, None)  # a request that failed may have left part of it
    assert book.holds(1) == [] and book.entry_of(1) is None


def test_a_restore_of_what_is_not_an_entry_is_saved_next_time() -> None:
    book = SlotBook()
    book.pinned()
    book.restored(0, [1, 2], None)  # a pair of the earlier layout
    assert book.holds(0) == [1, 2] and book.entry_of(0) is None


def test_without_pinned_requests_nothing_is_taken_as_unchanged() -> None:
    book = SlotBook()  # not pinned: a request may have run in any slot
    book.saved(0, [1], "k0")
    assert book.entry_of(0) is None
    book.pinned()
    book.forgotten()  # a request the server put where it chose
    assert book.entry_of(0) is None and book.known() == {} and list(book.slots()) == [0]


def test_the_other_built_ins_read_tokens_per_slot() -> None:
    book = SlotBook()
    book.served(0, [1, 2, 3])
    book.restored(2, [4], "k")
    assert book.tokens_per_slot() == {0: 3, 2: 1}
