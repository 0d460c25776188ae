"""Reading and rewriting a llama-server command line (`-x VALUE`, `--long VALUE`, `--long=VALUE`)."""

from __future__ import annotations

from collections.abc import Sequence

HOST = ("--host",)
PORT = ("--port",)
MODEL = ("-m", "--model")
ALIAS = ("-a", "--alias")  # the model's names in the API, comma-separated
API_KEY = ("--api-key",)
API_KEY_FILE = ("--api-key-file",)
CTX_SIZE = ("-c", "--ctx-size")
PARALLEL = ("-np", "--parallel")
CACHE_TYPE_K = ("-ctk", "--cache-type-k")
CACHE_TYPE_V = ("-ctv", "--cache-type-v")
FLASH_ATTN = ("-fa", "--flash-attn")
SLOT_SAVE_PATH = ("--slot-save-path",)
SWA_FULL = ("--swa-full",)
KV_UNIFIED = ("-kvu", "--kv-unified")
NO_KV_UNIFIED = ("-no-kvu", "--no-kv-unified")
CACHE_IDLE_SLOTS = ("--cache-idle-slots",)
NO_CACHE_IDLE_SLOTS = ("--no-cache-idle-slots",)
CACHE_RAM = ("-cram", "--cache-ram")
CACHE_REUSE = ("--cache-reuse",)
SLOT_PROMPT_SIMILARITY = ("-sps", "--slot-prompt-similarity")
MMPROJ = ("-mm", "--mmproj", "-mmu", "--mmproj-url")
SPEC = ("-md", "--model-draft", "--spec-draft-model", "-hfd", "--hf-repo-draft", "--spec-type",
        "--spec-draft-n-max", "--spec-default")  # speculative decoding (a draft model, or a --spec-type)
GPU_LAYERS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
METRICS = ("--metrics",)


def _matches(arg: str, names: Sequence[str]) -> tuple[bool, str | None]:
    """Whether `arg` is one of `names`, and its inline `=value` if it has one."""
    name, eq, inline = arg.partition("=")
    if name in names:
        return True, inline if eq else None
    return False, None


def get(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last occurrence of an option that takes a value."""
    value = None
    for index, arg in enumerate(argv):
        hit, inline = _matches(arg, names)
        if hit:
            value = inline if inline is not None else (argv[index + 1] if index + 1 < len(argv) else None)
    return value


def has(argv: Sequence[str], names: Sequence[str]) -> bool:
    return any(_matches(arg, names)[0] for arg in argv)


def last_of(argv: Sequence[str], on: Sequence[str], off: Sequence[str]) -> bool | None:
    """For a pair of switches (`-kvu`/`-no-kvu`): the one given last, or None if neither is."""
    state = None
    for arg in argv:
        if _matches(arg, on)[0]:
            state = True
        elif _matches(arg, off)[0]:
            state = False
    return state


def remove(argv: Sequence[str], names: Sequence[str], takes_value: bool = True) -> list[str]:
    """`argv` without every occurrence of the option (and its value)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        hit, inline = _matches(arg, names)
        if hit:
            skip = takes_value and inline is None
            continue
        out.append(arg)
    return out


def replace(argv: Sequence[str], names: Sequence[str], value: str | None) -> list[str]:
    """Remove the option wherever it is and append it once, with `value` (None: a plain switch)."""
    out = remove(argv, names, takes_value=value is not None)
    out.append(names[-1] if names[-1].startswith("--") else names[0])
    if value is not None:
        out.append(value)
    return out


def offloaded(argv: Sequence[str]) -> bool:
    """Whether layers go to a GPU (-ngl given and not 0)."""
    return get(argv, GPU_LAYERS) not in (None, "0")


def unified_kv(argv: Sequence[str]) -> bool:
    """One KV for all slots: -kvu, or llama-server's default when the slot count is automatic (no -np, or -1)."""
    unified = last_of(argv, KV_UNIFIED, NO_KV_UNIFIED)
    if unified is None:
        given = get(argv, PARALLEL)
        return given is None or given.strip() == "-1"
    return unified
