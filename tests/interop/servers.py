"""Servers the interop tests run in a thread of the test process, each on a free loopback port."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


@contextmanager
def uvicorn_thread(app: Any, **config: Any) -> Iterator[str]:
    """``app`` served by uvicorn in a daemon thread on a free loopback port; yields its base URL."""
    import uvicorn

    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **config))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


class ScriptedModel:
    """An OpenAI-compatible chat endpoint that answers with fixed assistant turns, in order.

    It stands in for the model where a test needs the actions fixed (golden-trace replay through a
    framework that drives its own model calls); every request body is kept in ``requests``. Both
    plain and streamed (server-sent events) completions are served, as clients ask for either.
    """

    def __init__(self, replies: Sequence[str]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            if len(self.requests) > len(self.replies):
                return JSONResponse({"error": {"message": "the script has no more replies"}}, status_code=400)
            text = self.replies[len(self.requests) - 1]
            head = {
                "id": f"scripted-{len(self.requests)}",
                "created": 0,
                "model": body.get("model", "scripted"),
            }
            usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            if not body.get("stream"):
                message = {"role": "assistant", "content": text}
                choice = {"index": 0, "finish_reason": "stop", "message": message}
                return JSONResponse(
                    {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
                )
            chunk = {**head, "object": "chat.completion.chunk"}
            first = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}
            last = {"index": 0, "delta": {}, "finish_reason": "stop"}
            events = [{**chunk, "choices": [first]}, {**chunk, "choices": [last], "usage": usage}]
            lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
            return StreamingResponse(iter(lines), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

        return Starlette(
            routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)]
        )
