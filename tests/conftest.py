"""Session-wide fixtures: rank pools are shared by all tests and stopped once at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import IMPL_UNDER_TEST, shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    yield
    shutdown_pools()


@pytest.fixture
def fsdp2_only() -> None:
    """Skip unless the suite tests fsdp2: the test relies on fsdp2-only behaviour or names."""
    if IMPL_UNDER_TEST != "fsdp2":
        pytest.skip(f"fsdp2-only test; FSDP2_TEST_IMPL={IMPL_UNDER_TEST}")
