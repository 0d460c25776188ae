"""A client of the wrapper in a thread, as an agent or a person asks: one request, streamed or not, with what it
saw and when (its first token, its end), for the priority tests and bench_priority."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from http.client import HTTPConnection
from typing import Any

AGENT_TASK = "Write a very long story about a dragon and a knight, in many chapters."
QUESTION = "What is the capital of France?"


class Asked:
    """POST `body` to `path` in a thread; `headers` say its class. Streamed answers are read event by event."""

    def __init__(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self.url, self.path, self.body, self.headers = url, path, body, headers or {}
        self.status = 0
        self.events: list[dict[str, Any]] = []  # a stream's events ({"done": True} for [DONE])
        self.answer: dict[str, Any] | None = None  # a JSON answer
        self.raw = b""
        self.began = 0.0
        self.first_token: float | None = None  # seconds from sending to the first text
        self.took: float | None = None  # seconds from sending to the end
        self.ended_at: float | None = None  # time.monotonic() at the end
        self._tokens = 0
        self._seen = threading.Condition()
        self._connection: HTTPConnection | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Asked:
        self.thread.start()
        return self

    def join(self, timeout: float = 600) -> Asked:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.path} not answered within {timeout}s"
        return self

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        """Until `n` tokens of text came (a stream), or the answer ended."""
        with self._seen:
            assert self._seen.wait_for(lambda: self._tokens >= n or self.took is not None, timeout), \
                f"{n} tokens did not come within {timeout}s"

    def hang_up(self) -> None:
        """Go away as a client does (shut down: closing alone does not reach the peer while a read blocks)."""
        sock = self._connection.sock if self._connection is not None else None  # the reader may close it at once
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    @property
    def text(self) -> str:
        if self.answer is not None:
            if "choices" in self.answer:
                return str(self.answer["choices"][0]["message"]["content"])
            return str(self.answer.get("content"))
        return "".join(_text(e) for e in self.events)

    @property
    def tokens(self) -> int:
        """Events that carried text (a token each)."""
        return sum(1 for e in self.events if _text(e))

    @property
    def finals(self) -> int:
        return sum(1 for e in self.events if (e.get("choices") or [{}])[0].get("finish_reason") or e.get("stop"))

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        connection = self._connection = HTTPConnection(host, int(port), timeout=900)
        self.began = time.monotonic()
        try:
            connection.request("POST", self.path, json.dumps(self.body),
                               {"Content-Type": "application/json", **self.headers})
            reply = connection.getresponse()
            self.status = reply.status
            if reply.getheader("Content-Type", "").startswith("text/event-stream"):
                for raw in reply:
                    self._line(raw)
            else:
                self.raw = reply.read()
                self.answer = json.loads(self.raw)
                self._text_came()
        except (OSError, ValueError):
            pass  # hung up, or cut: what came is what it saw
        finally:
            connection.close()
            self.ended_at = time.monotonic()
            with self._seen:
                self.took = self.ended_at - self.began
                self._seen.notify_all()

    def _line(self, raw: bytes) -> None:
        self.raw += raw
        line = raw.decode().strip()
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        event = {"done": True} if data == "[DONE]" else json.loads(data)
        self.events.append(event)
        if _text(event):
            self._text_came()

    def _text_came(self) -> None:
        with self._seen:
            if self.first_token is None:
                self.first_token = time.monotonic() - self.began
            self._tokens += 1
            self._seen.notify_all()


def _text(event: dict[str, Any]) -> str:
    """The text an event carries: a chat chunk's content or reasoning, a /completion event's content, a Responses
    text delta, a Messages text block delta (a tool call's arguments are not text)."""
    if "choices" in event:
        delta = (event["choices"] or [{}])[0].get("delta", {})
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    if event.get("type") == "response.output_text.delta":
        return str(event.get("delta") or "")
    if event.get("type") == "content_block_delta":
        return str((event.get("delta") or {}).get("text") or "")
    return str(event.get("content") or "")


def agent(url: str, max_tokens: int, stream: bool = True, headers: dict[str, str] | None = None,
          path: str = "/v1/chat/completions", **extra: Any) -> Asked:
    """A long greedy answer (it never stops early), as an agent asks for it: chat completions, /completion,
    /v1/responses (Codex) or /v1/messages (Claude Code)."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if path.endswith(("chat/completions", "/messages")):
        body["messages"] = [{"role": "user", "content": AGENT_TASK}]
    elif path.endswith("/responses"):
        body["input"] = AGENT_TASK
        body["max_output_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = AGENT_TASK + "\n\n"
    return Asked(url, path, body, {"X-Priority": "background"} if headers is None else headers)


def person(url: str, question: str = QUESTION, max_tokens: int = 24) -> Asked:
    return Asked(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": question}],
                                               "max_tokens": max_tokens, "temperature": 0, "stream": True})


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
BACKGROUND = {"X-Priority": "background"}  # the README's header mark


@dataclass(frozen=True)
class Kind:
    """A kind of agent people run, marked as the README shows: what it sends and the chat template the server runs
    (llama.cpp's own, in the build's templates/; None: the model's)."""

    name: str
    template: str | None
    path: str
    extra: dict[str, Any]
    headers: dict[str, str]

    def ask(self, url: str, max_tokens: int) -> Asked:
        return agent(url, max_tokens, headers=self.headers, path=self.path, **self.extra)


LLAMA_31 = "meta-llama-Llama-3.1-8B-Instruct"
KINDS = [
    Kind("plain", None, "/v1/chat/completions", {"service_tier": "flex"}, {}),  # the README's body mark
    Kind("tools", LLAMA_31, "/v1/chat/completions", {"tools": TOOLS, "tool_choice": "auto"}, BACKGROUND),
    Kind("reasoning", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "/v1/chat/completions", {}, BACKGROUND),
    Kind("responses", LLAMA_31, "/v1/responses", {}, BACKGROUND),  # Codex
    Kind("messages", LLAMA_31, "/v1/messages", {"model": "demo"}, BACKGROUND),  # Claude Code
]


def prompt_n(asked: Asked) -> int | None:
    """The prompt tokens llama-server read for a streamed chat answer (its last `timings`), None when not told."""
    told = [e["timings"]["prompt_n"] for e in asked.events if isinstance(e.get("timings"), dict)]
    return int(told[-1]) if told else None
