"""How loud the wrapper logs what llama-server does: a crash at error, its error and warning lines at their levels."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import Wrapper, child_argv
from wrapper.server import output as server_output
from wrapper.server.child import Exit

# Lines as the pinned llama-server prints them (common/log.cpp's prefix: a timestamp, then the level letter).
ERROR_LINE = "0.00.006.220 E srv    load_model: failed to load model, '/nowhere.gguf'"
WARNING_LINE = ("0.00.002.468 W srv  llama_server: security: no API key is set and CORS allows all origins "
                "(see https://github.com/ggml-org/llama.cpp/pull/25655)")
INFO_LINE = "0.00.003.455 I srv    load_model: loading model '/models/SmolLM2-135M-Instruct.Q4_1.gguf'"


@pytest.mark.parametrize(("line", "level"), [
    (ERROR_LINE, logging.ERROR),
    (WARNING_LINE, logging.WARNING),
    (INFO_LINE, None),
    ("0.00.001.000 D slot update: id 0 | n_past = 12", None),
    ("E srv    operator(): no timestamps (--no-log-timestamps)", logging.ERROR),
    ("\x1b[34m0.00.000.001\x1b[0m \x1b[31mE cannot bind the port\x1b[0m", logging.ERROR),  # --log-colors on
    ('{"type":"log","time":1973,"level":"warn","msg":"srv  llama_server: security: no API key is set\\n"}',
     logging.WARNING),  # --log-jsonl
    ('{"type":"log","time":9,"level":"error","msg":"srv  llama_server: exiting due to model loading error\\n"}',
     logging.ERROR),
    ('{"type":"log","time":819,"level":"info","msg":"srv  llama_server: initializing ...\\n"}', None),
    # argument errors, printed before the log starts
    ('error while handling argument "--flash-attn": error: unknown value for --flash-attn: \'bogus\'', logging.ERROR),
    ("error: invalid argument: --nonsense", logging.ERROR),
    ("usage:", None),
    ("ERR [              load_model] unable to load model | tid=1", logging.ERROR),  # older builds
    ("WARN [            validate] something | tid=1", logging.WARNING),
    ("{not json", None),
    ("Every colour is fine: no error here", None),
    ("load_tensors: E and W as words are not marks", None),
    ("", None),
])
def test_llama_servers_own_marks_give_the_level(line: str, level: int | None) -> None:
    assert server_output.server_line_level(line) == level


def test_unmarked_lines_stay_info_or_debug_as_the_built_ins_say() -> None:
    assert server_output.server_output_level(INFO_LINE, shown=True) == logging.INFO
    assert server_output.server_output_level(INFO_LINE, shown=False) == logging.DEBUG  # -lv 4's extra lines
    assert server_output.server_output_level(ERROR_LINE, shown=False) == logging.ERROR  # an error is never noise
    assert server_output.server_output_level(WARNING_LINE, shown=True) == logging.WARNING


@pytest.mark.parametrize(("finished", "crashed", "level"), [
    (Exit(0), False, logging.INFO),
    (Exit(0, asked=True), False, logging.INFO),
    (Exit(-signal.SIGTERM, asked=True), False, logging.INFO),  # our SIGTERM
    (Exit(3, asked=True), False, logging.INFO),  # a code of its own after our SIGTERM: we asked it to go
    (Exit(-signal.SIGKILL, killed=True, asked=True), False, logging.WARNING),  # past the stop timeout
    (Exit(-signal.SIGSEGV), True, logging.ERROR),
    (Exit(-signal.SIGABRT), True, logging.ERROR),
    (Exit(-signal.SIGSEGV, asked=True), True, logging.ERROR),  # it crashed while stopping
    (Exit(-signal.SIGKILL), True, logging.ERROR),  # not ours: the kernel's OOM kill
    (Exit(-signal.SIGTERM), True, logging.ERROR),  # someone else's SIGTERM
    (Exit(1), True, logging.ERROR),  # a non-zero exit nobody asked for
])
def test_an_exit_nobody_asked_for_is_a_crash(finished: Exit, crashed: bool, level: int) -> None:
    assert (finished.crashed, finished.log_level) == (crashed, level)


def test_a_child_that_dies_by_sigsegv_is_logged_at_error(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv("--die-after", "0.5", "--die-signal", "SIGSEGV"),
                 "watchdog: {enabled: false}\n") as wrapper:
        assert wrapper.wait(30) == 128 + signal.SIGSEGV
    (exited,) = wrapper.events("child.exited")
    assert (exited["level"], exited["signal"]) == ("error", "SIGSEGV"), exited
    (lost,) = wrapper.events("wrapper.server_lost")
    assert (lost["level"], lost["reason"], lost["why"]) == ("error", "crash", "killed by SIGSEGV"), lost


def test_a_child_stopped_as_asked_is_logged_at_info(tmp_path: Path) -> None:
    with Wrapper(tmp_path, child_argv()) as wrapper:
        wrapper.wait_ready(30)
        assert wrapper.stop(30) == 0
    (exited,) = wrapper.events("child.exited")
    assert (exited["level"], exited["code"]) == ("info", 0), exited
    assert {e["level"] for e in wrapper.events("server.output")} == {"info"}  # the child's plain lines


def test_llama_servers_error_and_warning_lines_go_out_at_their_levels(tmp_path: Path) -> None:
    """A child that prints what llama-server prints when it cannot load its model, and exits 1."""
    script = f"print({INFO_LINE!r}); print({WARNING_LINE!r}); print({ERROR_LINE!r}, flush=True); raise SystemExit(1)"
    with Wrapper(tmp_path, [sys.executable, "-c", script]) as wrapper:
        assert wrapper.wait(30) == 3  # the start failed
    levels = {e["line"]: e["level"] for e in wrapper.events("server.output")}
    assert levels == {INFO_LINE: "info", WARNING_LINE: "warning", ERROR_LINE: "error"}, levels
    (exited,) = wrapper.events("child.exited")
    assert (exited["level"], exited["code"]) == ("error", 1), exited
