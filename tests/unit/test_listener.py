"""The HTTP face against a tiny real child: the admin endpoints, on or off, and why."""

from __future__ import annotations

import json
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
