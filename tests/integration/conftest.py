from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import models, swap
from tests.s3server import S3Server, skip_without_weed


@pytest.fixture(scope="session")
def server_bin() -> str:
    return models.llama_server()


@pytest.fixture(scope="session")
def demo_path() -> str:
    return models.demo()


@pytest.fixture(scope="session")
def gemma_path() -> str:
    return models.gemma()


@pytest.fixture(scope="session")
def llama_swap_bin() -> str:
    """The pinned llama-swap (llama-swap/build-llama-swap); skipped, saying why, only without a Go toolchain."""
    return swap.binary()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory, server_bin: str) -> str:
    return models.tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def other_tiny_path(tmp_path_factory: pytest.TempPathFactory, server_bin: str) -> str:
    """A second tiny model (three layers): another model id, a slot file that is not ours."""
    return models.tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-3.gguf", n_layer=3)


@pytest.fixture
def slots_dir(tmp_path: Path) -> Path:
    return tmp_path / "slots"


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) of the test's own, its bucket empty."""
    skip_without_weed()
    with S3Server(tmp_path / "s3") as server:
        yield server
