"""asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def first_of(*awaitables: Awaitable[Any]) -> None:
    """Wait until one of the awaitables is done, then cancel the others."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
