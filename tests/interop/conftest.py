"""A ``toolgym serve`` server in a thread of the test process, on a free loopback port."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from toolgym.serve import EnvServer, create_app

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # golden.py is imported by name
    sys.path.insert(0, str(HERE))


@contextmanager
def running_server(
    env_id: str, *, token: str | None = None, reap_every: float = 5.0, **server_args: Any
) -> Iterator[tuple[str, EnvServer]]:
    import uvicorn

    server = EnvServer(env_id, **server_args)
    app = create_app(server, token=token, reap_every=reap_every)
    uv = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", timeout_keep_alive=75
        )
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture
def serve() -> Callable[..., Any]:
    """``with serve(env_id, ...) as (url, server):`` a server for the block's duration."""
    return running_server
