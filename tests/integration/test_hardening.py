"""The wrapper in front of the real llama-server, used the way agents, benchmarks and attackers use it."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.helpers import http, peak_rss_kib, pid_alive, running, wait_for

CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 2, "temperature": 0}
PERSIST = """
slots: {{dir: {dir}}}
server: {{drain_timeout: {drain}}}
hooks:
  on_startup:
    - builtin: slots.restore
  on_will_stop:
    - builtin: slots.save
"""


async def _one(session: aiohttp.ClientSession, url: str, index: int) -> int:
    stream = index % 2 == 0
    if index % 3 == 0:
        path, body = "/completion", {"prompt": "Colours:", "n_predict": 2, "stream": stream}
    else:
        path, body = "/v1/chat/completions", {**CHAT, "stream": stream}
    async with session.post(url + path, json=body) as reply:
        data = await reply.read()
        if reply.status == 200 and stream:
            assert data.rstrip().endswith(b"[DONE]") or b'"stop":true' in data, data[-200:]
        return reply.status


async def _sequential(url: str, count: int) -> dict[int, int]:
    statuses: dict[int, int] = {}
    fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
    reused = aiohttp.ClientSession()
    async with fresh, reused:
        for index in range(count):
            session = fresh if index % 4 < 2 else reused  # fresh and kept-alive client connections
            status = await _one(session, url, index)
            statuses[status] = statuses.get(status, 0) + 1
            if index % 5 == 4:
                await asyncio.sleep(0.2)  # with and without a pause between requests
    return statuses


async def _concurrent_streams(url: str, count: int) -> list[int]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(_one(session, url, 2 * index) for index in range(count))))


def test_500_sequential_mixed_requests_and_64_concurrent_streams_all_answer_200(
        tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """llama-server closes the connection after a streamed answer; no client may see that as a 502."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "4096", "-np", "4"]) as wrapper:
        assert asyncio.run(_sequential(wrapper.url, 500)) == {200: 500}
        assert asyncio.run(_concurrent_streams(wrapper.url, 64)) == [200] * 64
    assert not wrapper.events("proxy.upstream_error")


def _busy(server_url: str) -> bool:
    status, _, raw = http("GET", f"{server_url}/slots")
    assert status == 200, raw
    return any(slot["is_processing"] for slot in json.loads(raw))


def _idle_after_hang_up(server_url: str) -> bool:
    """Whether the slot is free within 15 s; polled slowly, because every /slots call delays llama-server's own
    check of the closed connection (it looks only after one second without any result)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(2.5)
        if not _busy(server_url):
            return True
    return False


def _hang_up_after(port: int, body: dict[str, Any], seconds: float) -> bytes:
    """POST /completion, read whatever comes for `seconds` of wall time, then close the connection, as a user
    closing a chat window does (a per-read timeout would never fire on a stream that keeps coming)."""
    connection = HTTPConnection("127.0.0.1", port, timeout=seconds)
    received = b""
    deadline = time.monotonic() + seconds
    try:
        connection.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        while time.monotonic() < deadline:
            chunk = reply.read1(4096)
            if not chunk:
                break
            received += chunk
    except TimeoutError:
        pass
    finally:
        connection.close()
    return received


def test_a_client_that_hangs_up_stops_the_generation(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    long_answer = {"prompt": "Once upon a time", "n_predict": 4000, "ignore_eos": True}
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "1"]) as wrapper:
        server_url = wrapper.status()["server"]["url"]
        for stream in (False, True):
            received = _hang_up_after(wrapper.port, {**long_answer, "stream": stream}, seconds=1.5)
            if stream:
                assert received  # it was generating when the client left
            assert _idle_after_hang_up(server_url), f"still generating for a client that left (stream={stream})"
            assert wrapper.status()["requests"]["in_flight"] == 0


def test_a_stop_with_a_generation_in_flight_cuts_it_and_saves(tmp_path: Path, server_bin: str,
                                                               demo_path: str) -> None:
    """The drain deadline cuts the request, so the save runs on an idle slot and lands; no SIGKILL needed."""
    config = PERSIST.format(dir=tmp_path / "slots", drain="1s")
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "8192", "-np", "1"], config) as wrapper:
        answers: list[Any] = []

        async def generate() -> None:
            async with aiohttp.ClientSession() as session, session.post(
                    f"{wrapper.url}/completion", json={"prompt": "Once upon a time", "n_predict": 6000,
                                                       "ignore_eos": True}) as reply:
                answers.append((reply.status, await reply.read()))

        async def stop_while_generating() -> None:
            task = asyncio.ensure_future(generate())
            server_url = wrapper.status()["server"]["url"]
            await asyncio.to_thread(wait_for, lambda: _busy(server_url), 30, "the generation to start")
            wrapper.signal_group(signal.SIGTERM)
            await asyncio.wait_for(task, 60)

        asyncio.run(stop_while_generating())
        assert wrapper.wait(60) == 0
    assert answers[0][0] == 503 and b"cut at the drain deadline" in answers[0][1]
    (stopped,) = wrapper.events("wrapper.stopped")
    saved = wrapper.events("slots.saved")
    assert saved and saved[0]["tokens"] >= 4, wrapper.events("hook.run")  # the prompt at least, and what came
    exited = wrapper.events("child.exited")[0]
    assert exited["code"] == 0 and not exited["killed_after_timeout"]
    print(f"\nstop with a generation in flight: {stopped['stop_s']} s (drain_timeout 1 s), "
          f"save {saved[0]['total_ms']} ms")


SPELLINGS = [
    "/./slots/0", "/x/../slots/0", "/v1/../slots/0", "//slots/0", "/%73lots/0", "/slots%2F0", "/slots/./0",
    "/%2e/slots/0", "/.%2e/slots/0", "/slots/0/", "/slots/0;x", "/a/b/../../slots/0", "/../slots/0",
]


def _raw_post(port: int, target: str, body: dict[str, Any]) -> int:
    connection = HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", target, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return connection.getresponse().status
    finally:
        connection.close()


def test_slot_actions_are_refused_in_every_spelling(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    slots_dir = tmp_path / "slots"
    with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1"],
                 PERSIST.format(dir=slots_dir, drain="5s")) as wrapper:
        assert http("POST", f"{wrapper.url}/completion", {"prompt": "Hello there", "n_predict": 4})[0] == 200
        server_url = wrapper.status()["server"]["url"]
        held = json.loads(http("GET", f"{server_url}/slots")[2])[0]["n_prompt_tokens"]
        targets = [f"{spelling}?action={action}" for spelling in SPELLINGS for action in ("erase", "save")]
        targets += [f"http://127.0.0.1:{wrapper.port}/./slots/0?action=erase"]  # absolute-form request target
        refused = {target: _raw_post(wrapper.port, target, {"filename": "slot0.bin"}) for target in targets}
        assert {t: s for t, s in refused.items() if s not in (400, 403)} == {}
        assert json.loads(http("GET", f"{server_url}/slots")[2])[0]["n_prompt_tokens"] == held  # not erased
        folder = next(slots_dir.iterdir())
        assert not list(folder.glob("slot0.bin*"))  # nothing written under a name the wrapper owns
        assert http("GET", f"{wrapper.url}/slots")[0] == 200  # reading stays allowed


def test_the_api_key_is_not_given_away(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    key = "sesame-2c9f1e"
    argv = [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1", "--api-key", f"other,{key}"]
    reader = tmp_path / "read-token"
    reader.write_text("read-only-5e1f\n")
    with running(tmp_path, argv, f"admin: {{read_token_file: {reader}}}\n") as wrapper:
        reading = {"Authorization": "Bearer read-only-5e1f"}  # the wrapper's own: llama-server does not know it
        for path in ("/wrapper/status", "/metrics", "/v1/loads", "/slots"):
            assert http("GET", wrapper.url + path, headers=reading)[0] == 200, path
        assert http("POST", f"{wrapper.url}/completion", {"prompt": "Hi", "n_predict": 2}, headers=reading)[0] == 401
        assert wrapper.health() == 200  # /health stays open, as llama-server's does
        status, _, raw = http("GET", f"{wrapper.url}/wrapper/status")
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
        assert http("GET", f"{wrapper.url}/wrapper/status", headers={"Authorization": "Bearer wrong"})[0] == 401
        for headers in ({"Authorization": f"Bearer {key}"}, {"X-Api-Key": key}, {"Authorization": "Bearer other"}):
            status, _, raw = http("GET", f"{wrapper.url}/wrapper/status", headers=headers)
            assert status == 200 and key not in raw.decode() and "<redacted>" in raw.decode()
        for headers in ({"Authorization": f"bearer {key}"}, {"Authorization": key}):  # read as llama-server's check
            status, _, raw = http("POST", f"{wrapper.url}/completion", {"prompt": "Hi", "n_predict": 2},
                                  headers=headers)  # agrees: passed on in the form it reads (lower case: 401 before)
            assert status == 200, (headers, raw[:200])
        assert wrapper.stop() == 0
    assert key not in wrapper.log_path.read_text()


async def _upload(url: str, megabytes: int) -> int:
    async def body() -> Any:
        chunk = b" " * (1 << 20)
        for _ in range(megabytes):
            yield chunk

    async with aiohttp.ClientSession() as session:
        try:
            async with session.post(f"{url}/completion", data=body(),
                                    headers={"Content-Length": str(megabytes << 20)}) as reply:
                return reply.status
        except aiohttp.ClientError:
            return 0  # the server cut the upload off: just as good


def test_an_unauthenticated_upload_is_not_held_in_memory(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    argv = [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1", "--api-key", "sesame"]
    with running(tmp_path, argv) as wrapper:
        before = peak_rss_kib(wrapper.process.pid)

        async def three_uploads() -> list[int]:
            return list(await asyncio.gather(*(_upload(wrapper.url, 300) for _ in range(3))))

        assert set(asyncio.run(three_uploads())) <= {401, 0}
        peak = peak_rss_kib(wrapper.process.pid)
        print(f"\nwrapper peak memory: {before / 1024:.0f} MiB before, {peak / 1024:.0f} MiB after 3 x 300 MB uploads")
        assert peak - before < 100 * 1024, (before, peak)  # streamed through, never held whole
        assert wrapper.health() == 200


BAD_REQUESTS = [
    b"GET /health\rHTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\nHost: x\n\n\rX: y\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n",
]


def _send_raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def test_bad_requests_get_a_400_and_at_most_one_log_line_each(tmp_path: Path, server_bin: str,
                                                               tiny_path: str) -> None:
    with running(tmp_path, [server_bin, "-m", tiny_path, "-c", "1024", "-np", "1"]) as wrapper:
        lines_before = len(wrapper.log_path.read_text().splitlines())
        for data in BAD_REQUESTS:
            reply = _send_raw(wrapper.port, data)
            assert reply[:12] in (b"HTTP/1.1 400", b"HTTP/1.0 400") or (data.startswith(b"\x16") and not reply), data
        assert wrapper.health() == 200
        assert wrapper.stop() == 0
    added = [line for line in wrapper.log_path.read_text().splitlines()[lines_before:]
             if '"server.output"' not in line]
    for line in added:
        json.loads(line)  # every line is one JSON event: no traceback, no raw bytes
    library = [json.loads(line) for line in added if '"library.log"' in line]
    assert len(library) <= len(BAD_REQUESTS)
    assert "Traceback" not in wrapper.log_path.read_text()


def test_the_demo_model_answers_a_chat(tmp_path: Path, server_bin: str, demo_path: str) -> None:
    """Only what holds for any sensible answer: where the model stops and what it names depend on the CPU's
    kernels (an AVX-512 machine and an EPYC without it part ways under greedy sampling)."""
    with running(tmp_path, [server_bin, "-m", demo_path, "-c", "2048", "-np", "1"]) as wrapper:
        status, _, raw = http("POST", f"{wrapper.url}/v1/chat/completions",
                              {**CHAT, "max_tokens": 64}, timeout=120)
    assert status == 200, raw[:300]
    reply = json.loads(raw)
    answer = reply["choices"][0]
    assert answer["finish_reason"] in ("stop", "length"), answer
    assert answer["finish_reason"] == "stop" or reply["usage"]["completion_tokens"] == 64, reply["usage"]
    content = answer["message"]["content"]
    assert content.strip() and any(c.isalpha() for c in content), content  # some words, not an empty answer
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):  # the chat template's own tokens stay out
        assert token not in content, content


def test_sigkill_during_saves_never_costs_the_good_pair(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    """Killed (SIGKILL) at random moments of its stop, 12 times: each next start restores a whole pair."""
    slots_dir = tmp_path / "slots"
    config = PERSIST.format(dir=slots_dir, drain="5s")
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "1"]
    text = "The lighthouse keeper counted the ships. " * 30
    with running(tmp_path, argv, config) as wrapper:
        assert http("POST", f"{wrapper.url}/completion", {"prompt": text, "n_predict": 4})[0] == 200
        assert wrapper.stop() == 0
    outcomes = []
    for attempt in range(12):
        with running(tmp_path, argv, config) as wrapper:
            (report,) = wrapper.status()["slots"]["restore"]
            outcomes.append(report["outcome"])
            assert report["outcome"] == "restored", report
            text += f" Turn {attempt}."
            assert http("POST", f"{wrapper.url}/completion", {"prompt": text, "n_predict": 4})[0] == 200
            child = wrapper.status()["server"]["pid"]
            wrapper.signal_group(signal.SIGTERM)
            time.sleep(0.004 * attempt)  # somewhere in the save, a little later each time
            wrapper.signal_group(signal.SIGKILL)
            wrapper.wait(10)
            wait_for(lambda: not pid_alive(child), 10, "llama-server to die with the wrapper")  # noqa: B023
    with running(tmp_path, argv, config) as wrapper:
        assert wrapper.status()["slots"]["restore"][0]["outcome"] == "restored"
        assert wrapper.stop() == 0
    folder = next(slots_dir.iterdir())
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]  # leftovers swept at start
    assert outcomes == ["restored"] * 12


def test_a_read_only_slot_folder_fails_each_save_cleanly(tmp_path: Path, server_bin: str, tiny_path: str) -> None:
    slots_dir = tmp_path / "slots"
    argv = [server_bin, "-m", tiny_path, "-c", "2048", "-np", "2"]
    with running(tmp_path, argv, PERSIST.format(dir=slots_dir, drain="5s")) as wrapper:
        for slot in (0, 1):
            body = {"prompt": f"Conversation {slot}. " * 20, "n_predict": 2, "id_slot": slot}
            assert http("POST", f"{wrapper.url}/completion", body)[0] == 200
        total = wrapper.status()["priority"]["slots"]  # -np 2 and the lane's slot
        folder = next(slots_dir.iterdir())
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
            wrapper.stop()
            pytest.skip("chattr +i is not available here (a read-only folder cannot be made for root)")
        try:
            assert wrapper.stop() == 0
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    failures = wrapper.events("slots.save_failed")
    assert sorted(f["slot"] for f in failures) == list(range(total))  # each slot tried, each failure its own
    assert not wrapper.events("hook.internal_error") and not wrapper.events("slots.internal_error")
    (save,) = [e for e in wrapper.events("hook.run") if e["action"] == "slots.save"]
    assert save["outcome"] == "failed" and "save failed:" in save["detail"]
