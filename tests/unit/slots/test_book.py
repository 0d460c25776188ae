"""What each slot holds, one owner: a slot is unchanged only while the store holds exactly what it holds."""

from __future__ import annotations

from hooks.slots.book import SlotBook


def test_a_slot_is_unchanged_from_its_save_or_restore_until_it_serves() -> None:
    book = SlotBook(total=2, exact=True)
    book.restored(0, [1, 2, 3], "k0")
    book.saved(1, [4, 5], "k1")
    assert (book.entry_of(0), book.entry_of(1)) == ("k0", "k1")
    book.served(0, [1, 2, 3, 4])
    assert book.entry_of(0) is None and book.holds(0) == [1, 2, 3, 4]  # the next save writes it
    book.served(1, None)  # a request that failed may have left part of it
    assert book.holds(1) == [] and book.entry_of(1) is None


def test_a_restore_of_what_is_not_an_entry_is_saved_next_time() -> None:
    book = SlotBook(exact=True)
    book.restored(0, [1, 2], None)  # a pair of the earlier layout
    assert book.holds(0) == [1, 2] and book.entry_of(0) is None


def test_without_pinned_requests_nothing_is_taken_as_unchanged() -> None:
    book = SlotBook(exact=False)  # a request may have run in any slot
    book.saved(0, [1], "k0")
    assert book.entry_of(0) is None
    book.exact = True
    book.forgotten()  # a request the server put where it chose
    assert book.entry_of(0) is None and book.known() == {} and list(book.slots()) == [0]
