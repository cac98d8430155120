"""Shared Docker sandbox fixtures for the sandbox tests (module-scoped: each module gets its own)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:  # sandboxkit (this folder) is imported by module name
    sys.path.insert(0, str(Path(__file__).parent))

from sandboxkit import mine, need_docker  # noqa: E402

from toolgym.tools.sandbox import DockerSandbox  # noqa: E402


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


@pytest.fixture(scope="module")
def resident():
    """One idle resident container: serial calls land in the same container while it stays clean."""
    need_docker()
    box = DockerSandbox(pool_size=1, memory_mb=128, max_output_bytes=256 * 1024)
    yield box
    box.close()
    assert mine(box) == []
