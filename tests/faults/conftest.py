from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# faultkit (this folder) and the trainer tests' toy environment are imported by module name
for folder in (HERE, HERE.parent / "training"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that stop the Docker engine run after every other test of the session.

    They restart it exactly as CI starts it, but a test that uses Docker at the same moment would
    see it gone; running them last also keeps a failed restart from failing unrelated tests.
    """
    last = [item for item in items if item.get_closest_marker("stops_docker")]
    if last:
        items[:] = [item for item in items if not item.get_closest_marker("stops_docker")] + last
