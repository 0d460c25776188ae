"""Whether a saved slot can be restored into the running server, and if not, exactly why."""

from __future__ import annotations

from typing import Any

from hooks.slotfile import SlotFile
from wrapper import argv as args

_ON = ("on", "auto", "1", "true", "enabled", "yes")


def server_settings(argv: list[str], env: dict[str, str], props: dict[str, Any],
                    facts: dict[str, Any]) -> dict[str, Any]:
    """The running server's settings that decide a slot file's layout (argv for flags, /props for the rest)."""
    np_given = args.get(argv, args.PARALLEL)
    unified = args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED)
    if unified is None:  # llama-server's default: unified when the slot count is automatic
        unified = np_given is None or np_given.strip() == "-1"
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


def skip_reason(slot: int, sidecar: dict[str, Any], header: SlotFile, model_id: str,
                server: dict[str, Any], state_version: int | None) -> str | None:
    """None when the file can be restored and will be reused; otherwise the reason to skip it."""
    saved_model = sidecar.get("model", {})
    if saved_model.get("id") != model_id:
        return (f"other model: saved for {saved_model.get('name')} ({saved_model.get('id')}), "
                f"the server runs {model_id}")
    if sidecar.get("bytes") != header.bytes or sidecar.get("tokens") != header.n_tokens:
        return "the sidecar does not describe this file (an interrupted save?)"
    if state_version is not None and header.version != state_version:
        return (f"state version {header.version} (written by build {sidecar.get('build') or '?'}), "
                f"this server (build {server['build']}) reads version {state_version}")
    if slot >= server["total_slots"]:
        return f"slot {slot} does not exist: the server has {server['total_slots']} slot(s) (-np)"
    if header.n_tokens > server["n_ctx"] > 0:
        return f"{header.n_tokens} tokens do not fit the server's context of {server['n_ctx']} per slot"
    kv = header.kv
    file_k = kv.k_types[0] if kv and kv.k_types else sidecar.get("cache_type_k")
    file_v = kv.v_types[0] if kv and kv.v_types else sidecar.get("cache_type_v")
    if (file_k, file_v) != (server["cache_type_k"], server["cache_type_v"]):
        return (f"cache types: the file has K {file_k} / V {file_v}, "
                f"the server runs K {server['cache_type_k']} / V {server['cache_type_v']}")
    if sidecar.get("flash_attn") != server["flash_attn"]:
        return f"flash attention {sidecar.get('flash_attn')} in the file, {server['flash_attn']} on the server"
    streams = kv.n_stream if kv else sidecar.get("kv_streams")
    if streams != server["kv_streams"]:
        return f"the file has {streams} KV stream(s), the server {server['kv_streams']} (-kvu / -np)"
    quantized_k = server["cache_type_k"] not in ("f16", "f32", "bf16")
    if quantized_k and bool(sidecar.get("attn_rot_disable")) != server["attn_rot_disable"]:
        return "KV rotation differs (LLAMA_ATTN_ROT_DISABLE changed between save and restore)"
    if header.n_media and not server["mmproj"]:
        return f"the file holds {header.n_media} media chunk(s) and the server has no --mmproj"
    if server["sliding_window"] and not server["swa_full"]:
        return ("sliding-window model without --swa-full: the server would not reuse the restored tokens "
                "(set slots.swa_full to auto or always)")
    return None
