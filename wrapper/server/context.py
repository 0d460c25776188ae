"""The context llama-server runs, which is not always the `-c` it was given: it caps each slot at the model's
training context and rounds up to a multiple of 256. Measured from its GET /props, or expected from an argv."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wrapper.configuration import argv as args
from wrapper.launching.launch import Launch

CELL_PAD = 256  # llama-server rounds a context (and, without -kvu, each slot's share) up to a multiple of this
AUTO_SLOTS = 4  # llama-server's slots when -np is not given (or -1); their KV is then unified
TRAINING_CONTEXT = "the model's training context"
PER_SLOT = ("--kv-unified-per-slot",)
# With these the training context llama-server caps a slot at is not the GGUF header's (YaRN re-adjusts it).
ROPE_SCALING = ("--rope-scaling", "--rope-scale", "--rope-freq-scale", "--yarn-orig-ctx")


@dataclass(frozen=True)
class ServerContext:
    """The context of a llama-server: as it reports it after its start (GET /props), or as expected from an
    argv before one. `runs` is what `-c` means for it: every slot's context added up, or with -kvu the shared
    pool, at most what the slots can use of it."""

    asked: int | None  # the -c it was given (None: not given, or 0)
    runs: int
    slot: int  # the context one conversation (slot) has
    slots: int
    unified: bool
    why: str | None = None  # why `runs` is not `asked`, or why a slot has less than its share

    def as_dict(self) -> dict[str, Any]:
        return {"asked": self.asked, "runs": self.runs, "slot": self.slot, "slots": self.slots, "why": self.why}


def _pad(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD


def _positive(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else 0
    except ValueError:
        return None
    return value if value > 0 else None


def asked_context(argv: Sequence[str]) -> int | None:
    """The -c an argv gives (None when unset, 0, or not a number)."""
    return _positive(args.get(argv, args.CTX_SIZE))


def training_context(launch: Launch) -> int | None:
    """The training context llama-server caps a slot at: the GGUF header's, unless rope scaling changes it."""
    train = launch.facts.get("context_length")
    if not isinstance(train, int) or train <= 0 or args.has(launch.argv, ROPE_SCALING):
        return None
    return train


def share(asked: int, slots: int, unified: bool) -> int:
    """What one slot would get of `asked` before any cap: the whole (padded) pool with -kvu, else its part."""
    pool = _pad(asked)
    return pool if unified else _pad(pool // max(1, slots))


def server_context(argv: Sequence[str], slot: int, slots: int, train: int | None) -> ServerContext:
    """The context of a llama-server started with `argv` whose /props says `slot` per slot and `slots` slots."""
    asked, unified = asked_context(argv), args.unified_kv(argv)
    if asked is None:
        return ServerContext(None, slot if unified else slot * slots, slot, slots, unified)
    runs = min(_pad(asked), slots * slot) if unified else slots * slot
    return ServerContext(asked, runs, slot, slots, unified, _why(argv, asked, runs, slot, slots, unified, train))


def expected_context(argv: Sequence[str], train: int | None) -> ServerContext | None:
    """What llama-server will run `argv` with (as the pinned build does); None when -c is not given."""
    asked = asked_context(argv)
    if asked is None:
        return None
    unified = args.unified_kv(argv)
    slots = _positive(args.get(argv, args.PARALLEL)) or AUTO_SLOTS
    slot = share(asked, slots, unified)
    for cap in (_positive(args.get(argv, PER_SLOT)), train):
        slot = min(slot, cap) if cap else slot
    runs = min(_pad(asked), slots * slot) if unified else slots * slot
    return ServerContext(asked, runs, slot, slots, unified, _why(argv, asked, runs, slot, slots, unified, train))


def _why(argv: Sequence[str], asked: int, runs: int, slot: int, slots: int, unified: bool,
         train: int | None) -> str | None:
    if slot < share(asked, slots, unified):
        if train is not None and slot == train:
            return TRAINING_CONTEXT
        if slot == _positive(args.get(argv, PER_SLOT)):
            return f"{PER_SLOT[0]} {slot}"
        return "llama-server's limit for one slot (GET /props)"
    if runs > asked:
        each = "" if unified or slots == 1 else " per slot"
        return f"llama-server rounds the context up to a multiple of {CELL_PAD}{each}"
    if runs != asked:
        return "as llama-server reports it (GET /props)"
    return None


def with_context(argv: Sequence[str], n_ctx: int) -> list[str]:
    """`argv` with its -c set to `n_ctx` where it stands (its last occurrence), the rest as it was."""
    out = list(argv)
    for index in range(len(out) - 1, -1, -1):
        name, eq, _ = out[index].partition("=")
        if name in args.CTX_SIZE:
            if eq:
                out[index] = f"{name}={n_ctx}"
            elif index + 1 < len(out):
                out[index + 1] = str(n_ctx)
            return out
    return [*out, args.CTX_SIZE[0], str(n_ctx)]
