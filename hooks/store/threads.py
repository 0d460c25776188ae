"""Blocking calls on daemon threads: a request to a hung object store must never keep the process alive after
the wrapper has stopped (the default executor's and ThreadPoolExecutor's threads are joined at exit; llama-swap
would wait, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def run(work: Callable[..., T], *args: Any) -> T:
    """`work(*args)` on a daemon thread of its own, awaited."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def body() -> None:
        try:
            result, error = work(*args), None
        except BaseException as exc:  # handed to the awaiting coroutine, as to_thread would
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for it any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=body, daemon=True, name=getattr(work, "__name__", "store")).start()
    return await done


def map_on(threads: int, work: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """`work` over `items` on at most `threads` daemon threads, results in order; the first error is raised once
    every item has been tried."""
    todo = list(enumerate(items))
    results: list[Any] = [None] * len(todo)
    errors: list[BaseException] = []
    pending: queue.Queue[tuple[int, T]] = queue.Queue()
    for item in todo:
        pending.put(item)

    def worker() -> None:
        while True:
            try:
                index, item = pending.get_nowait()
            except queue.Empty:
                return
            try:
                results[index] = work(item)
            except BaseException as exc:
                errors.append(exc)

    workers = [threading.Thread(target=worker, daemon=True, name="store-io") for _ in range(min(threads, len(todo)))]
    for each in workers:
        each.start()
    for each in workers:
        each.join()
    if errors:
        raise errors[0]
    return results
