"""Make the child fit for slot persistence (the three traps of slot files: SWA reuse, idle wipes, layout).

Each change is added only if this llama-server binary has the flag (its own `--help` says), and every
change or missing flag is returned as a note for the log.
"""

from __future__ import annotations

from hooks.slots.settings import SLOTS
from hooks.slots.stores import open_for
from wrapper.configuration import argv as args
from wrapper.configuration import consumers
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.consumers import CONSUMERS
from wrapper.kept import Kept
from wrapper.launching.flags import is_planning, supported_flags
from wrapper.launching.launch import Fitting, Launch

FALLBACK_CTX = 4096


def fit_for_slots(argv: list[str], launch: Launch, config: Config, shared: Kept) -> Fitting:
    """The slot built-ins' argv changes; `fitted` is this model's slot folder (created and its store opened, unless
    only planning)."""
    slot_dir = SLOTS.of(config).dir / launch.model.id
    fit = Fitting(list(argv), fitted=slot_dir)
    facts = launch.facts
    flags = supported_flags(argv[0])
    if flags is None:
        fit.note("could not read the flags of this llama-server from --help",
                 "persistence flags are added unchecked; if the server refuses one, drop it in your argv")

    def has(name: str) -> bool:
        return flags is None or name in flags

    if not is_planning():  # `llama-wrapper plan` creates nothing
        try:
            slot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"slots.dir: cannot create {slot_dir}: {exc.strerror}") from exc
    open_for(shared, slot_dir, config, local=is_planning())  # a plan sizes by what this host saved, too
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

    if consumers.isolating(CONSUMERS.of(config)) and (args.get(fit.argv, args.CACHE_RAM) or "").strip() != "0":
        if has("-cram"):
            fit.argv = args.replace(fit.argv, args.CACHE_RAM, "0")
            fit.note("-cram 0", "consumers.isolate: llama-server's RAM prompt cache would give a slot any consumer's "
                     "prompt (the conversation cache keeps each consumer's on disk instead)")
        else:
            fit.note("no -cram", "this server has no RAM prompt cache to turn off for consumers.isolate")
    ctx = args.get(fit.argv, args.CTX_SIZE)
    if ctx is None or ctx.strip() == "0":
        train = facts.get("context_length")
        known = train if isinstance(train, int) and train > 0 else None
        size = known or FALLBACK_CTX
        fit.argv = args.replace(fit.argv, args.CTX_SIZE, str(size))
        source = "the model's training context" if known else "a fallback"
        fit.note(f"-c {size} ({source})", "an unset context may be shrunk by --fit between runs, and a restore "
                 "fails when the tokens no longer fit; pass -c yourself to choose")

    window = facts.get("sliding_window")
    wants_swa_full = SLOTS.of(config).swa_full == "always" or (SLOTS.of(config).swa_full == "auto" and window)
    if wants_swa_full and not args.has(fit.argv, args.SWA_FULL):
        if has("--swa-full"):
            fit.argv.append("--swa-full")
            why = (f"sliding-window model (window {window}): without a full SWA cache a restored slot is not "
                   "reused" if window else "slots.swa_full is 'always'")
            fit.note("--swa-full", why)
        else:
            fit.note("LOST: --swa-full is not supported",
                     "restored slots of this sliding-window model would be re-processed; slots.restore skips them")
    elif window and SLOTS.of(config).swa_full == "never":
        fit.note("no --swa-full (slots.swa_full: never)",
                 "this sliding-window model will not reuse restored slots; slots.restore skips them")
    return fit
