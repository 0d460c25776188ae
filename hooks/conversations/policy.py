"""The conversation cache's choices, as pure functions: whether a chat request goes on in the slot that holds its
conversation without a lookup, which slot a looked-up request goes to, and whether the cached conversation sharing
the longest prefix with it is restored there or llama-server prefills."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from hooks.conversations.chain import Chain, Messages
from hooks.conversations.rates import Rates
from hooks.slots.book import SlotBook
from hooks.store.interface import common_prefix
from wrapper.configuration.consumers import name_of, share_for

ASSUMED_RESTORE_BPS = 1e9  # until a restore is measured
ASSUMED_CONVERT_BPS = 2e8  # until a conversion is measured


def dropped(known: list[int], count: int, tokens: list[int]) -> int:
    """How many of the `count` tokens a slot holds a request that takes it drops: `known` are its first tokens as
    the book knows them (a prompt's), `tokens` the request's. A request that begins with every known token and is
    at least `count` long goes on with all of it (an answer's tokens come back as the next turn's prompt); any
    other keeps only what it shares (nothing, when no token is known)."""
    shared = common_prefix(known, tokens)
    kept = count if known and shared == len(known) and len(tokens) >= count else shared
    return max(0, count - kept)


KEPT = "kept as it stands"  # unchanged since it was saved or restored: the store holds it


def needs_no_keeping(book: SlotBook, slot: int, tokens: list[int], min_tokens: int,
                     stored: Callable[[str], bool]) -> str | None:
    """Why what `slot` drops when it is left holding `tokens` (a request's prompt, or the beginning a cut keeps) need
    not be saved first (KEPT, or why it is worth nothing); None: it must be. `stored(key)`: whether the store holds that
    entry. A slot whose contents the book does not fully know is always saved (a save tells what it held)."""
    if book.partial(slot):
        return None
    count = book.count(slot)  # its prompt and the answer it generated
    if count < min_tokens:
        return f"shorter than cache.min_tokens ({min_tokens})"
    if dropped(book.holds(slot), count, tokens) < min_tokens:
        return f"what it drops is shorter than cache.min_tokens ({min_tokens})"  # the request goes on with it
    if (key := book.entry_of(slot)) is not None and stored(key):
        return KEPT
    return None


def goes_on_in(book: SlotBook, busy: Collection[int], asked: int | None, messages: Messages, min_tokens: int,
               longer_kept: Callable[[list[int], int], bool]) -> int | None:
    """The free slot holding the conversation a chat request goes on from (the longest, when two do): the slot whose
    last request's messages begin this one's. None when no slot does, or when the store may hold more of it than
    that slot — `longer_kept(known, n)`: an entry of at least `n` tokens that begins with the `known` ones (then the
    whole lookup decides, and a slot whose tokens the book does not know at all cannot be told from any other)."""
    held = [(chain.count, slot) for slot in range(book.total)
            if slot not in busy and (asked is None or slot == asked)
            and isinstance(chain := book.chain_of(slot), Chain) and messages.continues(chain)]
    if not held:
        return None
    slot = max(held)[1]
    known = book.holds(slot)
    if longer_kept(known, len(known) + min_tokens):
        return None
    return slot


def choose_slot(free: list[int], held: Mapping[int, list[int]], tokens: list[int],
                last_used: Mapping[int, float], min_tokens: int, unknown: Collection[int] = (),
                ours: Collection[int] | None = None, reach: Mapping[int, int] | None = None,
                last: Collection[int] = ()) -> int:
    """The slot sharing the longest prefix with the request, whatever share of what it holds that is
    (llama-server reuses any common prefix: a regenerate shares its question, not the answer that followed),
    as long as the prefix is more than a chat template's first tokens: at least `min_tokens`, or half of what
    the slot holds — the half only on a slot whose last request was of the same class or is not known (`ours`;
    None: any), or when the request goes on from all the slot holds: a person's short question and an agent's task
    share a chat template's system prompt, and that alone must not move one into the other's slot. Else an empty
    slot, else the one whose conversation is cheapest to move out (the shortest, then the least recently used), a
    slot holding what the book does not know (`unknown`: a request the server placed itself ran there, and it is
    saved before it is taken) last, and those in `last` (held by a consumer within its slot share) after all. `reach`:
    the most a slot may give the request (another consumer's, under `consumers.isolate`: the public beginning), which
    counts only when it is `min_tokens` or more."""
    reach = reach or {}
    shared = {s: min(common_prefix(held.get(s, []), tokens), reach.get(s, len(tokens))) for s in free}

    def half(s: int) -> bool:  # never on another consumer's slot: its owner would lose it for a short beginning
        kept = len(held.get(s, []))
        return s not in reach and 2 * shared[s] >= kept and (ours is None or s in ours or shared[s] == kept)

    continuing = [s for s in free if shared[s] and (shared[s] >= min_tokens or half(s))]
    if continuing:
        return max(continuing, key=lambda s: shared[s])
    return min(free, key=lambda s: (s in last, s in unknown, len(held.get(s, [])), last_used.get(s, 0.0)))


def within_slot_shares(free: list[int], owners: Mapping[int, str | None], consumer: str | None,
                       shares: Mapping[str, int]) -> tuple[list[int], set[int]]:
    """`consumers.shares.*.slots`: the free slots a request of `consumer` may take (its own alone, when it holds as
    many slots as its share and one of them is free), and those taken last (held by another consumer within its
    share: it keeps what it has while others are over theirs). A consumer's conversations of every `cache_salt` count
    together; a front-end's user is held to the front-end's share on its own."""
    named = {slot: name_of(owner) for slot, owner in owners.items() if owner}
    held = Counter(named.values())
    me = name_of(consumer) if consumer is not None else None
    share = share_for(shares, me)
    if me is not None and share is not None and held[me] >= share:
        own = [s for s in free if named.get(s) == me]
        free = own or free
    protected = {s for s in free if (owner := named.get(s)) and owner != me
                 and (theirs := share_for(shares, owner)) is not None and held[owner] <= theirs}
    return free, protected


SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's default --slot-prompt-similarity


def server_places(tokens: list[int], idle: Mapping[int, list[int] | None], last_used: Mapping[int, float],
                  similarity: float = SLOT_PROMPT_SIMILARITY) -> int | None:
    """Where llama-server puts a request it places itself (no `id_slot`: Messages), by its own rule
    (`get_available_slot`): the idle slot whose tokens share the largest fraction of the prompt, when that is more than
    `similarity` (the first of equals); else the least recently used idle slot (the last of equals). `idle`: each idle
    slot's tokens; None for a slot whose tokens are not known, and then None: it cannot be told."""
    if not tokens or not idle or any(held is None for held in idle.values()):
        return None
    best, best_share = None, 0.0
    for slot, held in sorted(idle.items()):
        share = common_prefix(held or [], tokens) / len(tokens) if held else 0.0
        if share > best_share and share > similarity:
            best, best_share = slot, share
    if best is not None:
        return best
    return max(sorted(idle), key=lambda s: (-last_used.get(s, -1.0), s))


UNTOLD = -1  # placed_in: which slot is whose cannot be told


def placed_in(processing: Collection[int], known: Collection[int]) -> int | None:
    """The slot a request the server placed itself runs in, from the slots the server says process and those `known`
    to run another request (pinned by the wrapper, or another such request already seen): the one slot left; None
    while none is (not started yet); UNTOLD when more than one is (two such requests at once)."""
    left = {slot for slot in processing if slot not in known}
    if len(left) > 1:
        return UNTOLD
    return next(iter(left), None)


@dataclass(frozen=True)
class Rule:
    min_tokens: int  # cache.min_tokens: a restore must win this many tokens
    margin: float  # cache.restore_margin
    restore_bps: int | None = None  # cache.restore_rate, when given (a slow disk)


@dataclass(frozen=True)
class Candidate:
    """The cached entry sharing the longest prefix with a request, and what bringing it back costs."""

    shared: int  # tokens it shares with the request
    in_slot: int  # tokens the chosen slot shares with the request already
    bytes: int
    convert: bool = False  # made for other cache types: converted before it is restored
    fetch_s: float = 0.0  # predicted time before it is on local disk (a remote tier)


@dataclass(frozen=True)
class Decision:
    restore: bool
    why: str
    miss: str | None  # how a prefill is counted among the misses; None for a restore
    gain: int = 0
    restore_s: float | None = None  # predicted: the fetch, the conversion, reading its bytes
    prefill_s: float | None = None  # predicted for the tokens it wins; None until a prefill rate is measured


def decide(candidate: Candidate | None, rates: Rates, rule: Rule) -> Decision:
    """Restore when the entry wins at least `rule.min_tokens` over what the slot holds and its predicted
    restore time times `rule.margin` is below the predicted prefill of what it wins.

    No rates yet: until a prefill has been measured on this machine for this model, a restore that wins at
    least `min_tokens` is done. A restore's cost is bounded by its bytes, a prefill's is unknown, and the
    first answer measures the prefill rate. Unmeasured restore and conversion rates are assumed
    (ASSUMED_RESTORE_BPS, ASSUMED_CONVERT_BPS) and a given `cache.restore_rate` replaces the measured one."""
    if candidate is None or candidate.shared == 0:
        return Decision(False, "not cached", "not cached")
    gain = candidate.shared - candidate.in_slot
    if gain <= 0 and candidate.shared < rule.min_tokens:
        return Decision(False, "not cached", "not cached")  # what it shares is a chat template's first tokens
    if gain <= 0:
        return Decision(False, "the slot holds as much", "the slot holds as much")
    restore_bps = rule.restore_bps or rates.restore_bps or ASSUMED_RESTORE_BPS
    convert_s = candidate.bytes / (rates.convert_bps or ASSUMED_CONVERT_BPS) if candidate.convert else 0.0
    restore_s = candidate.fetch_s + convert_s + candidate.bytes / restore_bps
    prefill_s = gain / rates.prefill_tps if rates.prefill_tps else None
    if gain < rule.min_tokens:
        return Decision(False, f"only {gain} tokens to win (cache.min_tokens {rule.min_tokens})", "too little to win",
                        gain, restore_s, prefill_s)
    if prefill_s is None:
        return Decision(True, f"wins {gain} tokens (no prefill rate measured yet)", None, gain, restore_s, None)
    if restore_s * rule.margin < prefill_s:
        return Decision(True, f"wins {gain} tokens", None, gain, restore_s, prefill_s)
    return Decision(False, "a prefill is quicker", "a prefill is quicker", gain, restore_s, prefill_s)
