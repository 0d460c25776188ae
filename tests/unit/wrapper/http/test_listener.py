"""The HTTP face against a tiny real child: the admin endpoints, on or off, and why."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers import child_argv, http, running


def test_without_a_readable_admin_token_the_wrapper_comes_up_with_its_admin_endpoints_off(tmp_path: Path) -> None:
    """examples/degrade.yaml names ~/.config/llama-wrapper/admin-token; without that file `run` exited 2."""
    token_file = tmp_path / "admin-token"
    with running(tmp_path, child_argv(), f"admin: {{token_file: {token_file}}}\n", timeout=30) as wrapper:
        (off,) = wrapper.events("admin.off")
        assert "does not exist; make one with" in off["why"]
        status, _, raw = http("POST", f"{wrapper.url}/wrapper/reload", {"n_ctx": 2048})
        message = json.loads(raw)["error"]["message"]
        assert status == 403 and message.startswith("admin endpoints are off: admin.token_file:"), message
        assert "make one with" in message


def _post_raw(url: str, data: bytes, token: str) -> tuple[int, str]:
    """POST `data` as it is (not JSON-encoded), with the admin token; the status and the error's message."""
    request = urllib.request.Request(url, data=data, method="POST", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, str(json.loads(error.read())["error"]["message"])


def test_an_admin_body_that_is_not_json_is_told_apart_from_json_that_is_not_an_object(tmp_path: Path) -> None:
    """A syntax error says "not valid JSON" and where; valid JSON of the wrong shape says what is expected."""
    token = "listener-token"
    with running(tmp_path, child_argv(), timeout=30, env={"LLAMA_WRAPPER_ADMIN_TOKEN": token}) as wrapper:
        reload, drain = f"{wrapper.url}/wrapper/reload", f"{wrapper.url}/wrapper/drain"
        status, message = _post_raw(reload, b'{"n_ctx": 2048,}', token)
        assert status == 400 and message.startswith("the body is not valid JSON: "), message
        assert "line 1 column 16" in message, message  # the parser's position: the stray comma's closing brace
        status, message = _post_raw(reload, b'{"n_ctx":\n  2048 x}', token)
        assert status == 400 and "not valid JSON" in message and "line 2 column 8" in message, message
        status, message = _post_raw(reload, b"\xff\xfe{}", token)
        assert status == 400 and message.startswith("the body is not valid JSON: not utf-8 text"), message
        for valid in (b"[1, 2]", b'"n_ctx"', b"2048", b"null", b""):
            status, message = _post_raw(reload, valid, token)
            assert status == 400 and message == "the body must be a JSON object of reload fields", (valid, message)
        status, message = _post_raw(drain, b'{"timeout": 30s}', token)
        assert status == 400 and message.startswith("the body is not valid JSON: ") and "line 1 column 15" in message
        status, message = _post_raw(drain, b'["30s"]', token)
        assert status == 400 and message.startswith("the body must be empty or {"), message
        assert wrapper.health() == 200  # none of them drained or reloaded anything
