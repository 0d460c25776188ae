"""Whether a saved slot can be restored into the running server, and if not, exactly why."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from hooks.kvfile.format import SlotFile
from wrapper.configuration import argv as args

_ON = ("on", "auto", "1", "true", "enabled", "yes")


def server_layout(argv: list[str], env: dict[str, str], props: dict[str, Any],
                    facts: dict[str, Any]) -> dict[str, Any]:
    """The running server's settings that decide a slot file's layout (argv for flags, /props for the rest)."""
    unified = args.unified_kv(argv)
    total_slots = int(props.get("total_slots") or 1)
    generation = props.get("default_generation_settings") or {}
    return {
        "cache_type_k": (args.get(argv, args.CACHE_TYPE_K) or "f16").lower(),
        "cache_type_v": (args.get(argv, args.CACHE_TYPE_V) or "f16").lower(),
        "flash_attn": "on" if (args.get(argv, args.FLASH_ATTN) or "auto").lower() in _ON else "off",
        "swa_full": args.has(argv, args.SWA_FULL),
        "sliding_window": facts.get("sliding_window"),
        "kv_unified": unified,
        "kv_streams": 1 if unified else total_slots,
        "total_slots": total_slots,
        "n_ctx": int(generation.get("n_ctx") or 0),
        "attn_rot_disable": env.get("LLAMA_ATTN_ROT_DISABLE", "") not in ("", "0"),
        "mmproj": args.has(argv, args.MMPROJ),
        "build": str(props.get("build_info", "")),
    }


class Mismatch(Enum):
    """Why a saved slot does not fit the running server."""

    OTHER_MODEL = "other model"
    SIDECAR = "sidecar"
    STATE_VERSION = "state version"
    NO_SUCH_SLOT = "no such slot"
    TOO_LONG = "too long"
    CACHE_TYPES = "cache types"
    FLASH_ATTN = "flash attention"
    STREAMS = "KV streams"
    ROTATION = "KV rotation"
    MEDIA = "media"
    SWA = "sliding window"


# The same model and tokens in another KV layout: a prefill of the saved tokens makes up for the restore.
WARMABLE = frozenset({Mismatch.STATE_VERSION, Mismatch.CACHE_TYPES, Mismatch.FLASH_ATTN, Mismatch.STREAMS,
                      Mismatch.ROTATION, Mismatch.SWA})


@dataclass(frozen=True)
class Skip:
    kind: Mismatch
    reason: str

    @property
    def warmable(self) -> bool:
        return self.kind in WARMABLE

    def __str__(self) -> str:
        return self.reason


def skip_reason(slot: int, sidecar: dict[str, Any], header: SlotFile, model_id: str,
                server: dict[str, Any], state_version: int | None) -> Skip | None:
    """None when the file can be restored and will be reused; otherwise why to skip it."""
    saved_model = sidecar.get("model", {})
    if saved_model.get("id") != model_id:
        return Skip(Mismatch.OTHER_MODEL, f"other model: saved for {saved_model.get('name')} "
                    f"({saved_model.get('id')}), the server runs {model_id}")
    if sidecar.get("bytes") != header.bytes or sidecar.get("tokens") != header.n_tokens:
        return Skip(Mismatch.SIDECAR, "the sidecar does not describe this file (an interrupted save?)")
    if state_version is not None and header.version != state_version:
        return Skip(Mismatch.STATE_VERSION, f"state version {header.version} (written by build "
                    f"{sidecar.get('build') or '?'}), this server (build {server['build']}) reads version "
                    f"{state_version}")
    if slot >= server["total_slots"]:
        return Skip(Mismatch.NO_SUCH_SLOT,
                    f"slot {slot} does not exist: the server has {server['total_slots']} slot(s) (-np)")
    if header.n_tokens > server["n_ctx"] > 0:
        return Skip(Mismatch.TOO_LONG,
                    f"{header.n_tokens} tokens do not fit the server's context of {server['n_ctx']} per slot")
    kv = header.kv
    file_k = kv.k_types[0] if kv and kv.k_types else sidecar.get("cache_type_k")
    file_v = kv.v_types[0] if kv and kv.v_types else sidecar.get("cache_type_v")
    if (file_k, file_v) != (server["cache_type_k"], server["cache_type_v"]):
        return Skip(Mismatch.CACHE_TYPES, f"cache types: the file has K {file_k} / V {file_v}, "
                    f"the server runs K {server['cache_type_k']} / V {server['cache_type_v']}")
    if sidecar.get("flash_attn") != server["flash_attn"]:
        return Skip(Mismatch.FLASH_ATTN,
                    f"flash attention {sidecar.get('flash_attn')} in the file, {server['flash_attn']} on the server")
    streams = kv.n_stream if kv else sidecar.get("kv_streams")
    if streams != server["kv_streams"]:
        return Skip(Mismatch.STREAMS,
                    f"the file has {streams} KV stream(s), the server {server['kv_streams']} (-kvu / -np)")
    quantized_k = server["cache_type_k"] not in ("f16", "f32", "bf16")
    if quantized_k and bool(sidecar.get("attn_rot_disable")) != server["attn_rot_disable"]:
        return Skip(Mismatch.ROTATION,
                    "KV rotation differs (LLAMA_ATTN_ROT_DISABLE changed between save and restore)")
    if header.n_media and not server["mmproj"]:
        return Skip(Mismatch.MEDIA,
                    f"the file holds {header.n_media} media chunk(s) and the server has no --mmproj")
    if server["sliding_window"] and not server["swa_full"]:
        return Skip(Mismatch.SWA, "sliding-window model without --swa-full: the server would not reuse the "
                    "restored tokens (set slots.swa_full to auto or always)")
    return None
