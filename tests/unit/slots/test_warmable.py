"""Which slots a start (or a wake) prefills after its restore: not one refused because the unified KV cache is full
with what was restored, which would push a restored conversation out again (seen by a user at every wake)."""

from __future__ import annotations

from hooks.slots.actions import warmable


def test_a_slot_refused_for_a_full_cache_is_not_prefilled_over_the_restored_ones() -> None:
    report = [
        {"slot": 0, "outcome": "restored", "tokens": 855},
        {"slot": 2, "outcome": "failed", "tokens": 1741,
         "reason": "HTTP 400: Unable to restore slot: No available space in KV cache"},
        {"slot": 1, "outcome": "failed", "tokens": 300, "reason": "HTTP 500: read error"},
        {"slot": 3, "outcome": "skipped", "warmable": True, "tokens": 90, "reason": "other cache types"},
        {"slot": 4, "outcome": "skipped", "tokens": 90, "reason": "another model"},
        {"slot": 5, "outcome": "failed", "tokens": 0, "reason": "empty"},
    ]
    assert [e["slot"] for e in warmable(report)] == [1, 3]
