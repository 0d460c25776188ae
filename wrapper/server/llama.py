"""A small client for the llama-server the wrapper runs: health, props, slots and slot actions."""

from __future__ import annotations

from typing import Any

import aiohttp


class LlamaError(Exception):
    """llama-server answered with an error or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class LlamaClient:
    def __init__(self, base_url: str, session: aiohttp.ClientSession, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._session = session
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def healthy(self, timeout: float = 1.0) -> bool:
        """True once the model is loaded (`/health` 200); False while loading or unreachable."""
        try:
            async with self._session.get(
                f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as reply:
                return reply.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def props(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._json("GET", "/props")
        return result

    async def slots(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._json("GET", "/slots")
        return result

    async def slot_action(self, slot: int, action: str, filename: str | None = None) -> dict[str, Any]:
        body = {"filename": filename} if filename is not None else {}
        result: dict[str, Any] = await self._json("POST", f"/slots/{slot}?action={action}", body)
        return result

    async def metrics(self) -> bytes:
        """llama-server's /metrics in the Prometheus text format; b"" when it has none or cannot be reached."""
        try:
            async with self._session.get(f"{self.base_url}/metrics", headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=10)) as reply:
                body = await reply.read()
                kind = reply.headers.get("Content-Type", "")
                return body if reply.status == 200 and kind.startswith("text/plain") else b""
        except (aiohttp.ClientError, TimeoutError):
            return b""

    async def prefill(self, slot: int, tokens: list[int]) -> dict[str, Any]:
        """Process `tokens` into slot `slot`'s cache (one token is generated and dropped)."""
        body = {"prompt": tokens, "n_predict": 0, "id_slot": slot, "cache_prompt": True, "temperature": 0}
        result: dict[str, Any] = await self._json("POST", "/completion", body)
        return result

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """Any endpoint's JSON answer (LlamaError for an error or no answer)."""
        return await self._json(method, path, body)

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self._session.request(
                method, f"{self.base_url}{path}", json=body, headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            ) as reply:
                data = await reply.json(content_type=None)
                if reply.status >= 400:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    message = error.get("message") if isinstance(error, dict) else None
                    raise LlamaError(f"{method} {path}: HTTP {reply.status}: {message or data}", reply.status)
                return data
        except aiohttp.ClientError as exc:
            raise LlamaError(f"{method} {path}: {exc}") from exc
        except ValueError as exc:
            raise LlamaError(f"{method} {path}: the answer is not JSON") from exc
