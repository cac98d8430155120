"""A ``toolgym serve`` server in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from toolgym.serving.guards import BODY_TIMEOUT_S, IDLE_TIMEOUT_S, uvicorn_options
from toolgym.serving.server import EnvServer, create_app

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # golden.py and servers.py are imported by name
    sys.path.insert(0, str(HERE))

from servers import uvicorn_thread  # noqa: E402


@contextmanager
def running_server(
    env_id: str,
    *,
    token: str | None = None,
    reap_every: float = 5.0,
    idle_timeout: float = IDLE_TIMEOUT_S,
    body_timeout: float = BODY_TIMEOUT_S,
    **server_args: Any,
) -> Iterator[tuple[str, EnvServer]]:
    """A server configured as ``toolgym serve`` configures its own (connection rules included)."""
    server = EnvServer(env_id, **server_args)
    app = create_app(server, token=token, reap_every=reap_every, body_timeout=body_timeout)
    with uvicorn_thread(app, lifespan="on", **uvicorn_options(idle_timeout=idle_timeout)) as url:
        yield url, server


@pytest.fixture
def serve() -> Callable[..., Any]:
    """``with serve(env_id, ...) as (url, server):`` a server for the block's duration."""
    return running_server
