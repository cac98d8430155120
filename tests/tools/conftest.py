"""Shared Docker sandbox fixtures for the sandbox tests (module-scoped: each module gets its own)."""

from __future__ import annotations

import os

import pytest

from toolgym.tools.sandbox import DockerSandbox, leaked_containers


def need_docker() -> None:
    """Skip only when TOOLGYM_SKIP_DOCKER=1 asks for it (CI never sets it)."""
    if os.environ.get("TOOLGYM_SKIP_DOCKER") == "1":
        pytest.skip("TOOLGYM_SKIP_DOCKER=1")


def mine(box: DockerSandbox) -> list[str]:
    """Containers of ``box`` still known to the engine, once handed-back ones are removed."""
    box.wait_removals()
    return leaked_containers(box.client, instance=box.instance)


@pytest.fixture(scope="module")
def sandbox():
    """A sandbox without a warm pool: every container it owns after a run is a leak."""
    need_docker()
    box = DockerSandbox(pool_size=0, memory_mb=128, pids=64, max_output_bytes=256 * 1024)
    yield box
    box.close()
    assert mine(box) == []


@pytest.fixture(scope="module")
def pooled():
    need_docker()
    box = DockerSandbox(pool_size=2)
    yield box
    box.close()
    assert mine(box) == []
