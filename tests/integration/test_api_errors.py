"""When the wrapper gives up on an answer, each API's own client is told, in that API's shape: the real `openai` and
`anthropic` packages raise — for a stream the wrapper ends itself and for an answer it refuses whole — on chat
completions, the Responses API and the Messages API, against the real llama-server (the demo model)."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.helpers import chat_yaml, http, running, wait_for
from tests.killing import server_pid

GIVE_UP = "watchdog: {restarts: 0}\n"  # the first crash is past the restart budget: the wrapper gives up on it
ASK = "Write a very long story about a dragon and a knight, in many chapters."
APIS = ["chat", "responses", "messages"]


def call(base: str, api: str, stream: bool) -> Iterator[Any]:
    """The API's own client asks for a long answer: its events one by one (a whole answer: one item)."""
    if api == "messages":
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=600)
        answer: Any = client.messages.create(model="demo", max_tokens=400, stream=stream,
                                             messages=[{"role": "user", "content": ASK}],
                                             extra_body={"ignore_eos": True})
    else:
        other = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        if api == "chat":
            answer = other.chat.completions.create(model="demo", max_tokens=400, stream=stream,
                                                   messages=[{"role": "user", "content": ASK}],
                                                   extra_body={"ignore_eos": True})
        else:
            answer = other.responses.create(model="demo", max_output_tokens=400, stream=stream, input=ASK,
                                            extra_body={"ignore_eos": True})
    if stream:
        yield from answer
    else:
        yield answer


def raised(work: Callable[[], object]) -> BaseException | None:
    try:
        work()
    except Exception as exc:  # what the client raised is the point
        return exc
    return None


@pytest.mark.parametrize("api", APIS)
def test_a_stream_the_wrapper_gives_up_on_raises_in_its_own_client(
        tmp_path: Path, server_bin: str, demo_path: str, api: str) -> None:
    """llama-server SIGKILLed mid-stream past the restart budget: the stream ends with the API's error event and the
    client raises (the anthropic SDK ignored the OpenAI-shaped line and returned a cut message before)."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"], chat_yaml(tmp_path, GIVE_UP)) \
            as wrapper:
        pid = server_pid(wrapper)
        seen = []

        def read() -> None:
            for event in call(wrapper.url, api, stream=True):
                seen.append(event)
                if len(seen) == 12:
                    os.kill(pid, signal.SIGKILL)

        error = raised(read)
        assert len(seen) >= 12, seen[-3:]
        expected = anthropic.APIStatusError if api == "messages" else openai.APIError
        assert isinstance(error, expected), (type(error), error)
        assert "llama-server" in str(error) or "restart" in str(error), str(error)


@pytest.mark.parametrize("api", APIS)
def test_an_answer_the_wrapper_gives_up_on_raises_in_its_own_client(
        tmp_path: Path, server_bin: str, demo_path: str, api: str) -> None:
    """The same, for an answer asked whole: an error status with a body in the API's shape (Anthropic's on
    /v1/messages), which the client raises with its message."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "1"], chat_yaml(tmp_path, GIVE_UP)) \
            as wrapper:
        pid = server_pid(wrapper)
        errors: list[BaseException | None] = []
        asking = threading.Thread(target=lambda: errors.append(raised(lambda: list(call(wrapper.url, api, False)))))
        asking.start()
        wait_for(lambda: any(s.get("is_processing") for s in json.loads(http("GET", f"{wrapper.url}/slots")[2])),
                 60, "the answer under way")
        os.kill(pid, signal.SIGKILL)
        asking.join(120)
        assert errors, "no answer"
        error = errors[0]
        expected = anthropic.APIStatusError if api == "messages" else openai.APIStatusError
        assert isinstance(error, expected), (type(error), error)
        assert error.status_code >= 500 and "llama-server" in str(error), (error.status_code, str(error))
        if api == "messages":
            body: Any = error.body
            assert body["type"] == "error" and body["error"]["type"] == "api_error", body
