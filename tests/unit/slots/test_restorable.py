"""The restore decision: every reason a saved slot is skipped, and proof of reuse from proxied responses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog

from hooks.kvfile.format import read
from hooks.slots.restorable import Mismatch, server_layout, skip_reason
from hooks.slots.reuse import ReuseTracker
from hooks.slots.transfer import upgradable
from tests.slotfiles import slot_bytes
from wrapper.lifecycle import IllegalTransition, Lifecycle, State
from wrapper.server.llama import LlamaClient

PROPS = {"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}, "build_info": "b11434-abc"}


def settings(*extra: str, env: dict[str, str] | None = None, window: int | None = None) -> dict[str, Any]:
    argv = ["llama-server", "-m", "m.gguf", "-kvu", "--swa-full", *extra]
    return server_layout(argv, env or {}, PROPS, {"sliding_window": window})


def sidecar(**overrides: Any) -> dict[str, Any]:
    base = {"model": {"id": "m1", "name": "m"}, "tokens": 3, "bytes": 0, "flash_attn": "on",
            "kv_streams": 1, "attn_rot_disable": False, "build": "b11434-abc"}
    base.update(overrides)
    return base


@pytest.fixture
def header(tmp_path: Path) -> Any:
    path = tmp_path / "slot0.bin"
    path.write_bytes(slot_bytes([1, 2, 3]))
    return read(path)


def reason(header: Any, slot: int = 0, state_version: int = 4, server: dict[str, Any] | None = None,
           **side: Any) -> str | None:
    skip = skip_reason(slot, sidecar(bytes=header.bytes, **side), header, "m1", server or settings(), state_version)
    return str(skip) if skip is not None else None


def test_a_matching_file_is_restored(header: Any) -> None:
    assert reason(header) is None


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"model": {"id": "other", "name": "big"}}, "other model: saved for big (other), the server runs m1"),
    ({"tokens": 99}, "the sidecar does not describe this file"),
    ({"state_version": 5}, "state version 4 (written by build b11434-abc), this server (build b11434-abc) reads "
                           "version 5"),
    ({"slot": 2}, "slot 2 does not exist: the server has 2 slot(s) (-np)"),
    ({"server": settings("-ctk", "q8_0", "-ctv", "q8_0")}, "cache types: the file has K f16 / V f16, "
                                                           "the server runs K q8_0 / V q8_0"),
    ({"flash_attn": "off"}, "flash attention off in the file, on on the server"),
    ({"server": settings("-no-kvu")}, "the file has 1 KV stream(s), the server 2 (-kvu / -np)"),
    ({"server": settings(window=512)}, None),
    ({"server": server_layout(["s", "-kvu"], {}, PROPS, {"sliding_window": 512})},
     "sliding-window model without --swa-full"),
])
def test_each_reason_to_skip(header: Any, kwargs: dict[str, Any], expected: str | None) -> None:
    slot = kwargs.pop("slot", 0)
    state_version = kwargs.pop("state_version", 4)
    server = kwargs.pop("server", None)
    got = reason(header, slot, state_version, server, **kwargs)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.startswith(expected), got


def test_too_many_tokens_for_the_context(header: Any) -> None:
    small = {**settings(), "n_ctx": 2}
    assert reason(header, server=small) == "3 tokens do not fit the server's context of 2 per slot"


def test_rotation_matters_only_for_quantized_keys(header: Any) -> None:
    quantized = settings("-ctk", "q8_0", "-ctv", "q8_0", env={"LLAMA_ATTN_ROT_DISABLE": "1"})
    header.kv.k_types = ["q8_0"] * len(header.kv.k_types)
    header.kv.v_types = ["q8_0"] * len(header.kv.v_types)
    assert reason(header, server=quantized) == (
        "KV rotation differs (LLAMA_ATTN_ROT_DISABLE changed between save and restore)")
    assert reason(header, server=quantized, attn_rot_disable=True) is None


def test_server_settings_defaults() -> None:
    got = server_layout(["s"], {}, {"total_slots": 4, "default_generation_settings": {"n_ctx": 8192}}, {})
    assert (got["cache_type_k"], got["flash_attn"], got["kv_unified"], got["kv_streams"]) == ("f16", "on", True, 1)
    explicit = server_layout(["s", "-np", "3", "-fa", "off"], {}, {"total_slots": 3}, {})
    assert (explicit["kv_unified"], explicit["kv_streams"], explicit["flash_attn"]) == (False, 3, "off")


async def test_reuse_is_read_from_the_proxied_response() -> None:
    tracker = ReuseTracker(LlamaClient("http://127.0.0.1:1", None))  # type: ignore[arg-type]
    entries = [{"slot": 0, "tokens": 1000}, {"slot": 1, "tokens": 800}]
    for entry in entries:
        tracker.expect(entry, total_slots=2)
    observe = tracker.observer()
    assert observe is not None
    with structlog.testing.capture_logs() as captured:
        observe("/completion", 200, b'{"content":"x","id_slot":1,"timings":{"cache_n":790,"prompt_n":5}}')
        observe("/completion", 200, b'data: {"id_slot":0,"timings":{"cache_n":10}}\n\n')
    assert entries[1]["reused_tokens"] == 790 and entries[1]["reused_share"] == 0.9875
    assert entries[0]["reused_tokens"] == 10
    assert [e["event"] for e in captured] == ["slots.reused", "slots.not_reused"]
    assert tracker.observer() is None  # nothing left to learn: the proxy stops watching


def test_state_transitions_are_checked() -> None:
    lifecycle = Lifecycle()
    lifecycle.to(State.STARTING)
    lifecycle.to(State.STOPPING)
    with pytest.raises(IllegalTransition):
        lifecycle.to(State.READY)
    lifecycle.to(State.STOPPED)


def test_what_a_prefill_can_make_up_for_is_typed_not_worded(header: Any) -> None:
    """Warming once matched the skip sentences: rewording one would have stopped it silently."""
    kinds = {
        "cache types": skip_reason(0, sidecar(bytes=header.bytes), header, "m1", settings("-ctk", "q8_0"), 4),
        "other model": skip_reason(0, sidecar(bytes=header.bytes), header, "m2", settings(), 4),
    }
    assert kinds["cache types"] is not None and kinds["cache types"].kind is Mismatch.CACHE_TYPES
    assert kinds["cache types"].warmable
    assert kinds["other model"] is not None and not kinds["other model"].warmable


@pytest.mark.parametrize(("written", "reads", "converts"), [(2, 4, True), (3, 4, False), (4, 2, False), (4, 4, False)])
def test_an_earlier_state_version_converts_and_a_later_one_is_warmed(tmp_path: Path, written: int, reads: int,
                                                                     converts: bool) -> None:
    path = tmp_path / "slot0.bin"
    path.write_bytes(slot_bytes([1, 2, 3], version=written, server_state=written >= 4))
    found = read(path)
    assert found.tokens == [1, 2, 3]
    if written == 3:  # between the two builds: its tokens are read, its layout is not walked (never converted)
        assert found.kv is None
    else:
        assert found.kv is not None and found.kv.n_layer == 2
    skip = skip_reason(0, sidecar(bytes=found.bytes, build="b9095-old"), found, "m1", settings(), reads)
    if written == reads:
        assert skip is None
        return
    assert skip is not None and skip.kind is Mismatch.STATE_VERSION and skip.warmable
    assert upgradable(skip, found, reads) is converts


def test_a_state_from_a_slot_the_server_has_not_is_skipped_at_info() -> None:
    """After -np was made smaller the missing slots' states are expected to be skipped (their conversations come
    back from the cache): info, not a warning per slot; a state that does not fit for another reason warns."""
    from structlog.testing import capture_logs

    from hooks.slots.actions import EXPECTED, _skipped
    from hooks.slots.restorable import Mismatch

    with capture_logs() as logs:
        _skipped({"slot": 3, "file": "s3.bin"}, "slot 3 does not exist", expected=Mismatch.NO_SUCH_SLOT in EXPECTED)
        _skipped({"slot": 0, "file": "s0.bin"}, "cache types", expected=Mismatch.CACHE_TYPES in EXPECTED)
    assert [(e["event"], e["log_level"]) for e in logs] == [("slots.restore_skipped", "info"),
                                                           ("slots.restore_skipped", "warning")]
