"""What the store's tests against a real S3 server share: the server (SeaweedFS, one per test module) and a prefix
of the test's own in its bucket."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.s3server import S3Server, skip_without_weed


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    skip_without_weed()
    with S3Server(tmp_path_factory.mktemp("s3")) as srv:
        yield srv


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"
