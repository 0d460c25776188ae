"""Proof of reuse: how many tokens the first request on each restored slot took from the cache."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import structlog

from wrapper.metrics import METRICS
from wrapper.server.llama import LlamaClient, LlamaError
from wrapper.steps import Observer

log = structlog.get_logger()

_CACHE_N = re.compile(rb'"cache_n"\s*:\s*(\d+)')
_ID_SLOT = re.compile(rb'"id_slot"\s*:\s*(\d+)')
REUSE_WARNING = 0.5  # below this share of the restored tokens, say plainly that the restore did not help


class ReuseTracker:
    """Watches proxied responses until every restored slot has served one request."""

    def __init__(self, client: LlamaClient) -> None:
        self._client = client
        self._pending: dict[int, dict[str, Any]] = {}
        self._total_slots = 1
        self._baseline: dict[int, Any] = {}  # each slot's last task when the restore was done
        self._lookups: set[asyncio.Task[None]] = set()

    def expect(self, entry: dict[str, Any], total_slots: int) -> None:
        """`entry` is a restore-report row; its `reuse` fields are filled in when the slot is next used."""
        entry["reused_tokens"] = None
        self._pending[int(entry["slot"])] = entry
        self._total_slots = total_slots

    async def snapshot(self) -> None:
        """Note each slot's last task now (after a restore or prefill): the slot whose task changes next is the
        one that served the next request."""
        try:
            slots = await self._client.slots()
        except LlamaError:
            return
        self._baseline = {int(slot["id"]): slot.get("id_task") for slot in slots if "id" in slot}

    def observer(self) -> Observer | None:
        return self._seen if self._pending else None

    def _seen(self, path: str, status: int, tail: bytes) -> None:
        if status != 200 or not self._pending:
            return
        cache_n = _CACHE_N.findall(tail)
        if not cache_n:
            return
        id_slot = _ID_SLOT.findall(tail)
        if id_slot:
            self._settle(int(id_slot[-1]), int(cache_n[-1]), path)
        elif self._total_slots == 1:
            self._settle(0, int(cache_n[-1]), path)
        else:
            # OpenAI-style answers don't name their slot: the answer's own cache_n goes to the restored slot that
            # ran a task since the restore (the server's /slots knows which; its own cache count there is 0).
            lookup = asyncio.ensure_future(self._from_slots(int(cache_n[-1]), path))
            self._lookups.add(lookup)
            lookup.add_done_callback(self._lookups.discard)

    async def _from_slots(self, cache_n: int, path: str) -> None:
        try:
            slots = await self._client.slots()
        except LlamaError:
            return
        served = [slot for slot in slots if slot.get("id") in self._pending and slot.get("id_task") is not None
                  and slot.get("id_task") != self._baseline.get(int(slot["id"])) and not slot.get("is_processing")]
        if served:
            latest = max(served, key=lambda slot: int(slot["id_task"]))
            self._settle(int(latest["id"]), cache_n, path)

    def _settle(self, slot: int, cache_n: int, path: str) -> None:
        entry = self._pending.pop(slot, None)
        if entry is None:
            return
        restored = int(entry.get("tokens") or 0)
        entry["reused_tokens"] = cache_n
        METRICS.reused_tokens.inc(cache_n)
        entry["reused_share"] = round(cache_n / restored, 4) if restored else None
        fields = {"slot": slot, "restored_tokens": restored, "cache_n": cache_n, "path": path}
        if restored and cache_n < REUSE_WARNING * restored:
            log.info("slots.not_reused", **fields,
                     why="the first request in this slot since its restore was another conversation (as when many "
                         "share few slots): the restored one was dropped there, and is still in the store")
        else:
            log.info("slots.reused", **fields)
