"""Who may reuse what (hooks/conversations/isolation.py): a consumer's own under isolation, and a `cache_salt`'s
conversation only its own salt's, isolated or not."""

from __future__ import annotations

from typing import Any

from hooks.conversations.isolation import PUBLIC, Asker
from hooks.store.interface import Entry, held_within
from wrapper.configuration.consumers import salted


def entry(owner: str | None, key: str = "k", size: int = 10, used: float = 0.0) -> Entry:
    record: dict[str, Any] = {"consumer": owner, "private": True} if owner is not None else {}
    return Entry(key, 100, size, used, record, key)


def test_a_salted_conversation_is_its_salts_alone_whether_consumers_are_isolated_or_not() -> None:
    mine, other = salted("alice", "one"), salted("alice", "two")
    for isolated in (False, True):
        alice = Asker("alice", isolated)
        assert not alice.mine(mine) and not alice.sees(entry(mine))  # the same consumer without the salt
        assert Asker(mine, True).mine(mine) and Asker(mine, True).sees(entry(mine))
        assert not Asker(other, True).mine(mine) and not Asker(other, True).sees(entry(mine))  # another salt
        assert Asker("bob", isolated).mine(PUBLIC)  # the public beginning: anyone's
    nobody = Asker()  # consumers not configured, no salt: anything but a salt's, as before
    assert nobody.mine(None) and nobody.mine("bob") and not nobody.mine(mine)
    assert Asker(mine, True).name == "alice" and Asker("open-webui/42").name == "open-webui/42"


def test_a_share_counts_a_consumers_salts_together_and_each_front_end_user_alone() -> None:
    entries = [entry(salted("alice", "one"), "a1", 10, 1.0), entry(salted("alice", "two"), "a2", 10, 2.0),
               entry("open-webui/u1", "u1", 10, 3.0), entry("open-webui/u2", "u2", 10, 4.0), entry(None, "n", 99)]
    going = held_within(entries, {"alice": 15, "open-webui": 10}, set())
    assert [e.key for e in going] == ["a1"]  # alice's 20 bytes over 15: her oldest; each user within 10
