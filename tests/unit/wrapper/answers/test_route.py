"""Which way a request goes and the shape its answer is read in, as tables."""

from __future__ import annotations

from typing import Any

import pytest

from wrapper.answers.route import BODY_LIMIT, Shape, Way, shape, way


@pytest.mark.parametrize(("method", "asleep_answer", "shown", "needs_body", "length", "expected"), [
    ("GET", True, True, False, None, Way.REMEMBERED),  # asleep: what it said awake, not woken
    ("GET", False, True, False, None, Way.SHOWN),  # a built-in rewrites what clients are told
    ("GET", False, False, False, None, Way.THROUGH),
    ("HEAD", True, True, False, None, Way.THROUGH),  # only a GET is remembered or rewritten
    ("POST", False, False, False, 100, Way.THROUGH),  # nothing needs the body again: streamed through
    ("POST", False, False, True, 100, Way.WHOLE),
    ("POST", False, False, True, None, Way.WHOLE),  # chunked: read whole, up to the limit
    ("POST", False, False, True, BODY_LIMIT + 1, Way.THROUGH),  # too large to keep: it cannot be sent again
    ("PUT", False, False, True, 100, Way.THROUGH),
])
def test_the_way_a_request_goes(method: str, asleep_answer: bool, shown: bool, needs_body: bool,
                                length: int | None, expected: Way) -> None:
    assert way(method, asleep_answer, shown, needs_body, length) is expected


STREAMED: dict[str, Any] = {"stream": True}
WHOLE: dict[str, Any] = {"stream": False}


@pytest.mark.parametrize(("payload", "continuing", "resumable", "pausable", "expected"), [
    (STREAMED, True, False, False, Shape.STREAM),  # a full context's cut goes on in the same stream
    (STREAMED, False, True, False, Shape.STREAM),  # a lost server's stream goes on
    (STREAMED, False, False, True, Shape.STREAM),  # a paused stream goes on
    (STREAMED, False, False, False, Shape.WHOLE),  # nothing goes on: passed through as it comes
    (WHOLE, False, False, True, Shape.GATHERED),  # a JSON answer that may be paused: a stream, gathered
    (WHOLE, True, True, False, Shape.WHOLE),  # a JSON answer caught whole, sent again or continued
    ({}, False, False, True, Shape.GATHERED),
    (None, True, True, False, Shape.WHOLE),  # not JSON: as it came
])
def test_the_shape_an_answer_is_read_in(payload: dict[str, Any] | None, continuing: bool, resumable: bool,
                                        pausable: bool, expected: Shape) -> None:
    assert shape(payload, continuing, resumable, pausable) is expected
