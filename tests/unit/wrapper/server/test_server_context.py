"""The context llama-server runs with, from what it reports (GET /props) or as expected from an argv; and how a
reload tells it. The figures are those the pinned build reported for the demo model (trained for 8192)."""

from __future__ import annotations

import pytest

from wrapper.configuration.config import Listen
from wrapper.launching.launch import Launch
from wrapper.launching.model import Model
from wrapper.life.reloader import _same_server, _Story, _told
from wrapper.server.context import ServerContext, expected_context, server_context, with_context

TRAIN = 8192
S = ["llama-server", "-m", "m.gguf"]


@pytest.mark.parametrize(("flags", "slot", "slots", "runs", "why"), [
    (["-c", "16384", "-np", "1"], 8192, 1, 8192, "the model's training context"),
    (["-c", "16384"], 8192, 4, 16384, "the model's training context"),  # the demo: 4 slots on one KV, each capped
    (["-c", "16384", "-np", "2"], 8192, 2, 16384, None),  # two KVs of 8192: as asked
    (["-c", "32768", "-np", "2"], 8192, 2, 16384, "the model's training context"),
    (["-c", "32768", "-np", "2", "-kvu"], 8192, 2, 16384, "the model's training context"),
    (["-c", "4000", "-np", "1"], 4096, 1, 4096, "llama-server rounds the context up to a multiple of 256"),
    (["-c", "4096", "-np", "2", "-kvu"], 4096, 2, 4096, None),
])
def test_what_runs_from_what_the_server_reports_and_as_expected(flags: list[str], slot: int, slots: int, runs: int,
                                                                why: str | None) -> None:
    measured = server_context([*S, *flags], slot, slots, TRAIN)
    assert (measured.runs, measured.why) == (runs, why)
    expected = expected_context([*S, *flags], TRAIN)
    assert expected is not None and (expected.runs, expected.slot, expected.slots) == (runs, slot, slots)


def test_without_a_training_context_or_a_c_nothing_is_capped_or_expected() -> None:
    assert expected_context([*S, "-np", "1"], TRAIN) is None
    uncapped = expected_context([*S, "-c", "16384", "-np", "1"], None)
    assert uncapped is not None and uncapped.runs == 16384 and uncapped.why is None


def test_the_context_is_rewritten_where_it_stands() -> None:
    assert with_context([*S, "-c", "16384", "-np", "1"], 8192) == [*S, "-c", "8192", "-np", "1"]
    assert with_context([*S, "--ctx-size=16384"], 8192) == [*S, "--ctx-size=8192"]
    assert with_context(S, 8192) == [*S, "-c", "8192"]


def launch(argv: list[str], notes: list[dict[str, str]] | None = None) -> Launch:
    return Launch(argv=argv, port=1, listen=Listen("127.0.0.1", 8080), model=Model(path="m.gguf", name="m", id="x"),
                  env={}, notes=notes or [], facts={"context_length": TRAIN})


def test_a_reload_tells_what_runs_in_its_changes() -> None:
    ran = launch([*S, "-c", "8192", "-np", "1"])
    capped = _Story.of(16384, ServerContext(16384, 8192, 8192, 1, True, "the model's training context"), ran)
    assert capped is not None
    assert _told(["-c 4096 -> 16384", "-ctk f16 -> q8_0"], capped, "4096") == \
        ["-c 4096 -> 16384 (asked 16384, runs 8192: the model's training context)", "-ctk f16 -> q8_0"]
    assert capped.message == "asked n_ctx 16384, llama-server runs 8192: the model's training context"
    shared = _Story.of(16384, ServerContext(16384, 16384, 8192, 4, True, "the model's training context"), ran)
    assert shared is not None and shared.suffix == \
        "(4 slots share 16384, each at most 8192: the model's training context)"
    assert _Story.of(4096, ServerContext(4096, 4096, 4096, 1, True), ran) is None
    assert _told(["-ctk f16 -> q8_0"], capped, "8192") is None  # the context is not news
    assert _told(["-c (unset) -> 16384"], capped, "8192") == [  # the user's argv had none, the wrapper gave 8192
        "-c 8192 -> 16384 (asked 16384, runs 8192: the model's training context)"]


def test_a_fit_s_context_is_told_with_the_fit_s_reason() -> None:
    notes = [{"change": "degrade: rung quantize-kv-q8, -c 8192 -> 5888",
              "why": "the largest context under the budget 300 MiB (degrade.budget); planned 299 MiB on the CPU"}]
    fitted = launch([*S, "-c", "5888", "-np", "1"], notes)
    story = _Story.of(8192, ServerContext(5888, 5888, 5888, 1, True), fitted)
    assert story is not None and story.suffix == ("(asked 8192, runs 5888: degrade: rung quantize-kv-q8: the largest "
                                                  "context under the budget 300 MiB (degrade.budget); planned 299 "
                                                  "MiB on the CPU)")
    assert _told([], story, "8192") == [f"-c 8192 -> 5888 {story.suffix}"]


def test_a_reload_is_compared_with_what_runs() -> None:
    now = [*S, "-np", "1", "-c", "8192", "--port", "1"]
    asked = [*S, "-np", "1", "--ctx-size", "16384", "--port", "2"]
    assert _same_server(now, asked, expected_context(asked, TRAIN))
    assert not _same_server(now, [*asked, "-ctk", "q8_0"], expected_context(asked, TRAIN))
    assert not _same_server(now, [*S, "-np", "1", "-c", "4096"], expected_context([*S, "-c", "4096"], TRAIN))
