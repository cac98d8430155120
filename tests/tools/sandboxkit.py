"""What every sandbox test module shares: the skip rule and the leak check (imported by name)."""

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
