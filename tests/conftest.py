"""Session-wide fixtures: rank pools are shared by all tests and stopped once at the end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import CRASHES, IMPL_UNDER_TEST, crash_report, shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools() -> Iterator[None]:
    yield
    shutdown_pools()


@pytest.fixture
def fsdp2_only() -> None:
    """Skip unless the suite tests fsdp2: the test relies on fsdp2-only behaviour or names."""
    if IMPL_UNDER_TEST != "fsdp2":
        pytest.skip(f"fsdp2-only test; FSDP2_TEST_IMPL={IMPL_UNDER_TEST}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show every rank crash the harness retried: a passing run must not hide one."""
    if CRASHES:
        terminalreporter.section(f"rank processes that crashed and were retried: {len(CRASHES)}")
        terminalreporter.write_line(crash_report())
