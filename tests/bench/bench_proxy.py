"""What the proxy costs: the wrapper and direct access to the same llama-server, measured side by side.

Prints a table of medians and ratios (wrapped / direct); the `cost` column of the small request's rows is the time
the wrapper adds to one request (`GET /v1/models`, on one reused connection). Requests alternate between the two
paths so that noise on a shared machine hits both alike. Then the same streams through a wrapper with what agents
and people share a server with (the slot built-ins, the conversation cache, `priority:`): the wrapper's CPU per
streamed token against the plain proxy's (what makes a generation resumable must not cost every token), and the
throughput at CONCURRENT streams. Run with `make bench` (it sets LLAMA_SERVER).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import models
from tests.helpers import Wrapper

SMALL_REQUESTS = 1000
STREAMS = 12
STREAM_TOKENS = 128
CONCURRENT = 16
CONCURRENT_TOKENS = 32
# e.g. SERVER_ARGS="-t 1" leaves a core to the proxy and the client, as a GPU server would
EXTRA_SERVER_ARGS = os.environ.get("SERVER_ARGS", "").split()
PROMPT = "Write a short story about a lighthouse keeper who counts ships."
AGENTS_CONFIG = """
slots: {{dir: {dir}}}
priority: {{background_keys: ["agent-key"]}}
hooks:
  on_startup: [{{builtin: slots.restore}}]
  on_will_stop: [{{builtin: slots.save}}]
"""


async def small_request(session: aiohttp.ClientSession, base: str) -> float:
    started = time.perf_counter()
    async with session.get(f"{base}/v1/models") as reply:
        await reply.read()
    return time.perf_counter() - started


async def stream(session: aiohttp.ClientSession, base: str, n_predict: int) -> tuple[float, float, int]:
    """(time to first token, decode tokens per second after it, tokens)."""
    body = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "stream": True, "cache_prompt": False,
            "ignore_eos": True}
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    async with session.post(f"{base}/completion", json=body) as reply:
        async for line in reply.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                if not first:
                    first = time.perf_counter()
                tokens += 1 if not json.loads(line[6:]).get("stop") else 0
    ended = time.perf_counter()
    return first - started, (tokens - 1) / (ended - first), tokens


async def concurrent(session: aiohttp.ClientSession, base: str, pid: int | None = None) -> tuple[float, float]:
    """Aggregate tokens per second of CONCURRENT simultaneous streams, and (`pid`: the wrapper's) the CPU seconds
    that process spent per token meanwhile (0 without one)."""
    started, cpu = time.perf_counter(), cpu_seconds(pid) if pid else 0.0
    results = await asyncio.gather(*(stream(session, base, CONCURRENT_TOKENS) for _ in range(CONCURRENT)))
    tokens = sum(r[2] for r in results)
    return tokens / (time.perf_counter() - started), (cpu_seconds(pid) - cpu) / tokens if pid else 0.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def streamed_cpu(session: aiohttp.ClientSession, wrapped: str, direct: str,
                       wrapper_pid: int) -> tuple[float, float, float]:
    """(the wrapper's CPU µs per streamed token, the wrapped and the direct decode rates' medians)."""
    rate: dict[str, list[float]] = {wrapped: [], direct: []}
    wrapper_cpu, wrapped_tokens = 0.0, 0
    for _ in range(STREAMS):
        for base in (wrapped, direct):
            cpu_before = cpu_seconds(wrapper_pid)
            _, tps, tokens = await stream(session, base, STREAM_TOKENS)
            if base == wrapped:
                wrapper_cpu += cpu_seconds(wrapper_pid) - cpu_before
                wrapped_tokens += tokens
            rate[base].append(tps)
    return wrapper_cpu / wrapped_tokens * 1e6, statistics.median(rate[wrapped]), statistics.median(rate[direct])


async def agents_rows(wrapped: str, direct: str, wrapper_pid: int) -> list[tuple[str, float, float, str]]:
    """The streams again, through the wrapper with the agents' config, as an agent's (background: its key)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     headers={"Authorization": "Bearer agent-key"}) as session:
        for base in (wrapped, direct):
            await stream(session, base, 8)
        cpu, _, _ = await streamed_cpu(session, wrapped, direct, wrapper_pid)
        agg, per_token = await concurrently(session, wrapped, direct, wrapper_pid)
    return [("wrapper CPU per streamed token (µs)", cpu, 0.0, "cpu"),
            (f"{CONCURRENT} concurrent streams (tokens/s, best)", max(agg[wrapped]), max(agg[direct]), "%"),
            (f"wrapper CPU per token at {CONCURRENT} streams (µs)", per_token, 0.0, "cpu")]


async def concurrently(session: aiohttp.ClientSession, wrapped: str, direct: str,
                       wrapper_pid: int) -> tuple[dict[str, list[float]], float]:
    """Two rounds of CONCURRENT streams each way: the rates, and the wrapper's least CPU per token (µs) in a round."""
    agg: dict[str, list[float]] = {wrapped: [], direct: []}
    per_token: list[float] = []
    for _ in range(2):
        for base in (wrapped, direct):
            rate, cpu = await concurrent(session, base, wrapper_pid if base == wrapped else None)
            agg[base].append(rate)
            if base == wrapped:
                per_token.append(cpu * 1e6)
    return agg, min(per_token)


async def measure(wrapped: str, direct: str, wrapper_pid: int) -> list[tuple[str, float, float, str]]:
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for base in (wrapped, direct):  # warm both paths and the server's cache of the prompt
            await small_request(session, base)
            await stream(session, base, 8)
        lat: dict[str, list[float]] = {wrapped: [], direct: []}
        for _ in range(SMALL_REQUESTS):
            for base in (wrapped, direct):
                lat[base].append(await small_request(session, base))
        rows.append(("small request latency (ms, median)", statistics.median(lat[wrapped]) * 1e3,
                     statistics.median(lat[direct]) * 1e3, "ms"))
        rows.append(("small request latency (ms, p90)", statistics.quantiles(lat[wrapped], n=10)[-1] * 1e3,
                     statistics.quantiles(lat[direct], n=10)[-1] * 1e3, "ms"))
        rows.append(("small request latency (ms, p99)", statistics.quantiles(lat[wrapped], n=100)[-1] * 1e3,
                     statistics.quantiles(lat[direct], n=100)[-1] * 1e3, "ms"))
        ttfb: dict[str, list[float]] = {wrapped: [], direct: []}
        rate: dict[str, list[float]] = {wrapped: [], direct: []}
        wrapper_cpu, wrapped_tokens, wrapped_wall = 0.0, 0, 0.0
        for _ in range(STREAMS):
            for base in (wrapped, direct):
                cpu_before, wall_before = cpu_seconds(wrapper_pid), time.perf_counter()
                first, tps, tokens = await stream(session, base, STREAM_TOKENS)
                if base == wrapped:
                    wrapper_cpu += cpu_seconds(wrapper_pid) - cpu_before
                    wrapped_wall += time.perf_counter() - wall_before
                    wrapped_tokens += tokens
                ttfb[base].append(first)
                rate[base].append(tps)
        rows.append(("stream time to first token (ms, median)", statistics.median(ttfb[wrapped]) * 1e3,
                     statistics.median(ttfb[direct]) * 1e3, "ms"))
        rows.append(("stream decode rate (tokens/s, median)", statistics.median(rate[wrapped]),
                     statistics.median(rate[direct]), "%"))
        rows.append(("wrapper CPU per streamed token (µs)", wrapper_cpu / wrapped_tokens * 1e6, 0.0, "cpu"))
        rows.append(("wrapper CPU while streaming (% of one core)", wrapper_cpu / wrapped_wall * 100, 0.0, "cpu"))
        agg, per_token = await concurrently(session, wrapped, direct, wrapper_pid)
        rows.append((f"{CONCURRENT} concurrent streams (tokens/s, best)", max(agg[wrapped]), max(agg[direct]), "%"))
        rows.append((f"wrapper CPU per token at {CONCURRENT} streams (µs)", per_token, 0.0, "cpu"))
    return rows


def run(tmp: Path, config: str | None,
        measuring: Callable[[str, str, int], Coroutine[Any, Any, list[tuple[str, float, float, str]]]]
        ) -> list[tuple[str, float, float, str]]:
    tmp.mkdir()
    argv = [models.llama_server(), "-m", models.gemma(), "-c", str(CONCURRENT * 512), "-np", str(CONCURRENT),
            *EXTRA_SERVER_ARGS]
    wrapper = Wrapper(tmp, argv, config.format(dir=tmp / "slots") if config else None,
                      extra=["--log-level", "warning"])
    try:
        wrapper.wait_ready(120)
        return asyncio.run(measuring(wrapper.url, wrapper.status()["server"]["url"], wrapper.process.pid))
    finally:
        wrapper.stop()
        wrapper.kill()


def table(rows: list[tuple[str, float, float, str]]) -> None:
    print(f"| {'measure':<42} | {'wrapped':>9} | {'direct':>9} | {'wrapped/direct':>14} | {'cost':>12} |")
    print(f"|{'-' * 44}|{'-' * 11}|{'-' * 11}|{'-' * 16}|{'-' * 14}|")
    for name, w, d, unit in rows:
        if unit == "cpu":  # only the wrapper has this cost
            print(f"| {name:<42} | {w:>9.2f} | {'-':>9} | {'-':>14} | {'':>12} |")
            continue
        cost = f"{w - d:+.2f} ms" if unit == "ms" else f"{(w / d - 1) * 100:+.1f} %"
        print(f"| {name:<42} | {w:>9.2f} | {d:>9.2f} | {w / d:>14.3f} | {cost:>12} |")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain = run(Path(tmp) / "plain", None, measure)
        agents = run(Path(tmp) / "agents", AGENTS_CONFIG, agents_rows)
    extra = f", llama-server {' '.join(EXTRA_SERVER_ARGS)}" if EXTRA_SERVER_ARGS else ""
    print(f"\nllama-wrapper proxy cost, {Path(models.gemma()).name}{extra}, {os.cpu_count()} CPUs; "
          "wrapped and direct interleaved\n")
    table(plain)
    print("\nthe same streams through a wrapper with the slot built-ins, the conversation cache and priority:\n")
    table(agents)
    print()
    for name in ("wrapper CPU per streamed token (µs)", f"wrapper CPU per token at {CONCURRENT} streams (µs)"):
        plain_cpu = next(w for row, w, _, _ in plain if row == name)
        agents_cpu = next(w for row, w, _, _ in agents if row == name)
        print(f"{name[12:]}: {agents_cpu:.0f} with the agents' config, {plain_cpu:.0f} as a plain proxy: "
              f"x{agents_cpu / plain_cpu:.2f} (goal: within 10 %)")


if __name__ == "__main__":
    main()
