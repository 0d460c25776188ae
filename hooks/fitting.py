"""Make the child fit for slot persistence (the three traps in docs: SWA reuse, idle wipes, layout).

Each change is added only if this llama-server binary has the flag (its own `--help` says), and every
change or missing flag is returned as a note for the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wrapper import argv as args
from wrapper.gguf_meta import GGUFError, architecture_facts, read_metadata
from wrapper.model import Model
from wrapper.server_help import supported_flags

FALLBACK_CTX = 4096


@dataclass
class Fitting:
    argv: list[str]
    notes: list[dict[str, str]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # from the GGUF: architecture, sliding_window, ...

    def note(self, change: str, why: str) -> None:
        self.notes.append({"change": change, "why": why})


def fit_for_slots(argv: list[str], model: Model, slot_dir: Path, swa_policy: str) -> Fitting:
    fit = Fitting(list(argv))
    flags = supported_flags(argv[0])
    if flags is None:
        fit.note("could not read the flags of this llama-server from --help",
                 "persistence flags are added unchecked; if the server refuses one, drop it in your argv")

    def has(name: str) -> bool:
        return flags is None or name in flags

    if model.path:
        try:
            fit.facts = architecture_facts(read_metadata(model.path))
        except GGUFError as exc:
            fit.note("could not read the model's GGUF header", f"{exc}; SWA detection and -c default are off")

    slot_dir.mkdir(parents=True, exist_ok=True)
    if has("--slot-save-path"):
        old = args.get(fit.argv, args.SLOT_SAVE_PATH)
        fit.argv = args.replace(fit.argv, args.SLOT_SAVE_PATH, str(slot_dir))
        fit.note(f"--slot-save-path {slot_dir}" + (f" (was {old})" if old else ""),
                 "the wrapper owns this model's slot files")
    else:
        fit.note("LOST: --slot-save-path is not supported", "this server cannot save or restore slots at all")

    if args.last_of(fit.argv, args.KV_UNIFIED, args.NO_KV_UNIFIED) is False:
        fit.note("kept -no-kvu", "you asked for it; slot files then depend on -np (one KV stream per slot)")
    elif not args.has(fit.argv, args.KV_UNIFIED) and has("-kvu"):
        fit.argv.append("-kvu")
        fit.note("-kvu", "one KV stream whatever -np is, so slot files restore across -np changes")

    if not args.has(fit.argv, args.NO_CACHE_IDLE_SLOTS):
        if has("--no-cache-idle-slots"):
            fit.argv = args.remove(fit.argv, args.CACHE_IDLE_SLOTS, takes_value=False)
            fit.argv.append("--no-cache-idle-slots")
            fit.note("--no-cache-idle-slots", "otherwise idle slots are moved to the RAM cache and cleared, "
                     "and a save at stop finds them empty")
        elif has("-cram"):
            fit.argv = args.replace(fit.argv, args.CACHE_RAM, "0")
            fit.note("-cram 0", "this server lacks --no-cache-idle-slots; without a RAM prompt cache idle slots stay")
        else:
            fit.note("LOST: cannot keep idle slots", "this server has neither --no-cache-idle-slots nor -cram")

    ctx = args.get(fit.argv, args.CTX_SIZE)
    if ctx is None or ctx.strip() == "0":
        train = fit.facts.get("context_length")
        known = train if isinstance(train, int) and train > 0 else None
        size = known or FALLBACK_CTX
        fit.argv = args.replace(fit.argv, args.CTX_SIZE, str(size))
        source = "the model's training context" if known else "a fallback"
        fit.note(f"-c {size} ({source})", "an unset context may be shrunk by --fit between runs, and a restore "
                 "fails when the tokens no longer fit; pass -c yourself to choose")

    window = fit.facts.get("sliding_window")
    wants_swa_full = swa_policy == "always" or (swa_policy == "auto" and window)
    if wants_swa_full and not args.has(fit.argv, args.SWA_FULL):
        if has("--swa-full"):
            fit.argv.append("--swa-full")
            why = (f"sliding-window model (window {window}): without a full SWA cache a restored slot is not "
                   "reused" if window else "slots.swa_full is 'always'")
            fit.note("--swa-full", why)
        else:
            fit.note("LOST: --swa-full is not supported",
                     "restored slots of this sliding-window model would be re-processed; slots.restore skips them")
    elif window and swa_policy == "never":
        fit.note("no --swa-full (slots.swa_full: never)",
                 "this sliding-window model will not reuse restored slots; slots.restore skips them")
    return fit
