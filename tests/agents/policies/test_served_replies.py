"""Served policies against a hostile server: every reply is checked before anything uses it.

A loopback HTTP server stands in for a vLLM (or any OpenAI-compatible) server and answers each
request with what a broken or malicious one could send: NaN, infinite or positive logprobs, token ids
outside the vocabulary, more tokens than asked for, a 300 MB body (streamed from a small buffer, never
held whole) and a reply dripped a byte at a time. Each must end the request as a ``PolicyError``
(infrastructure: the episode is ``infra_error`` and never trained on), within the request's deadline
and without reading the whole body. What is tested is the policies' checks, not vLLM, so no engine runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from toolgym.agents.policies.http import HTTPPolicy
from toolgym.agents.policies.models import smollm2_path
from toolgym.core import SamplingParams
from toolgym.errors import PolicyError

MAX_TOKENS = 8
SAMPLING = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
TIMEOUT_S = 2.0
HUGE = 300 * 2**20
CHUNK = b"a" * 2**20

Answer = Callable[[BaseHTTPRequestHandler], None]


class Hostile:
    """A loopback server: GETs answer as a vLLM server of the embedded model; each POST runs ``answer``.

    ``sent`` counts the body bytes the last answer got out before the client hung up.
    """

    def __init__(self) -> None:
        self.answer: Answer = lambda h: send_json(h, completion([1, 2], [-0.5, -0.25]))
        self.sent = 0
        hostile = self
        models = {"data": [{"id": "toolgym-policy", "root": str(smollm2_path()), "max_model_len": 1024}]}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                send_json(self, {"version": "0.32.0"} if self.path == "/version" else models)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hostile.sent = 0
                try:
                    hostile.answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def send_json(handler: BaseHTTPRequestHandler, body: Any) -> None:
    data = json.dumps(body).encode()  # NaN and Infinity are written as JSON's parsers read them
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def completion(
    ids: list[Any], logprobs: list[Any], finish: str = "length", text: str = "x"
) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "token_ids": ids,
        "logprobs": {"token_logprobs": logprobs},
        "finish_reason": finish,
    }
    return {"choices": [choice], "usage": {"completion_tokens": len(ids)}}


def stream_huge(hostile: Hostile, reply: dict[str, Any], *, declared: bool) -> Answer:
    """``reply`` (a valid answer whose text is ``"@"``) with a 300 MB text instead, written a megabyte at a
    time (with or without a length)."""
    before, after = json.dumps(reply).split("@")

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declared:
            handler.send_header("Content-Length", str(len(before) + HUGE + len(after)))
        else:
            handler.send_header("Connection", "close")  # the body runs to the end of the connection
            handler.close_connection = True
        handler.end_headers()
        handler.wfile.write(before.encode())
        for _ in range(HUGE // len(CHUNK)):
            handler.wfile.write(CHUNK)
            hostile.sent += len(CHUNK)
        handler.wfile.write(after.encode())

    return answer


def drip(handler: BaseHTTPRequestHandler) -> None:
    """A valid completion sent one byte every 0.2 s (each read is quick; the whole is not)."""
    data = json.dumps(completion([1, 2], [-0.5, -0.25])).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    for i in range(len(data)):
        handler.wfile.write(data[i : i + 1])
        handler.wfile.flush()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    server = Hostile()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def policy(hostile: Hostile) -> Any:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    return VLLMServerPolicy(url=hostile.url, timeout_s=TIMEOUT_S)


def test_a_server_given_by_url_that_answers_without_a_key_is_named(hostile, caplog) -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    VLLMServerPolicy(url=hostile.url)
    assert f"the vLLM server at {hostile.url} answers without a key" in caplog.text
    assert "--middleware toolgym.agents.policies.vllm_guard.KeyGuard" in caplog.text


def prompt(policy: Any) -> list[int]:
    return policy.render([{"role": "user", "content": "hi"}])


async def generate(policy: Any, hostile: Hostile, answer: Answer) -> Any:
    hostile.answer = answer
    # NOTE: bounded here too, so a policy that never gives up fails the test instead of hanging it.
    return await asyncio.wait_for(policy.generate(prompt(policy), SAMPLING), TIMEOUT_S + 10)


# ----------------------------------------------------------------- the vLLM server policy
async def test_an_honest_reply_is_a_completion(policy, hostile) -> None:
    done = await generate(policy, hostile, lambda h: send_json(h, completion([1, 2], [-0.5, 0.0])))
    assert done.token_ids == (1, 2) and done.logprobs == (-0.5, 0.0) and done.finish_reason == "length"


async def test_a_logprob_a_rounding_step_above_zero_is_read_as_zero(policy, hostile) -> None:
    done = await generate(policy, hostile, lambda h: send_json(h, completion([1, 2], [-0.5, 5e-7])))
    assert done.logprobs == (-0.5, 0.0)


@pytest.mark.parametrize(
    ("logprobs", "match"),
    [
        ([-0.5, float("nan")], r"logprob nan at position 1: a logprob is a finite number <= 0"),
        ([float("inf"), -0.5], r"logprob inf at position 0: a logprob is a finite number <= 0"),
        ([-0.5, float("-inf")], r"logprob -inf at position 1"),
        ([0.5, -0.5], r"logprob 0.5 at position 0: a logprob is a finite number <= 0"),
        ([-0.5, None], r"logprob None at position 1, not a number"),
        ([-0.5], r"returned 1 logprobs for 2 sampled tokens"),
    ],
)
async def test_a_logprob_that_is_not_finite_and_at_most_zero_is_refused(
    policy, hostile, logprobs, match
) -> None:
    with pytest.raises(PolicyError, match=match):
        await generate(policy, hostile, lambda h: send_json(h, completion([1, 2], logprobs)))


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 99_999_999], r"token id 99999999 at position 1, outside the vocabulary \[0, 49152\)"),
        ([-5, 1], r"token id -5 at position 0, outside the vocabulary \[0, 49152\)"),
        ([1, 49_152], r"token id 49152 at position 1, outside the vocabulary"),
        ([1, "7"], r"token id '7' at position 1, not an integer"),
        ([True, 1], r"token id True at position 0, not an integer"),
        ([1.0, 1], r"token id 1.0 at position 0, not an integer"),
    ],
)
async def test_a_token_id_outside_the_vocabulary_is_refused(policy, hostile, ids, match) -> None:
    with pytest.raises(PolicyError, match=match):
        await generate(policy, hostile, lambda h: send_json(h, completion(ids, [-0.5, -0.5])))


async def test_more_tokens_than_max_tokens_are_refused(policy, hostile) -> None:
    reply = completion([1] * 5000, [-0.5] * 5000)
    with pytest.raises(PolicyError, match=r"returned 5000 tokens for a request of max_tokens=8"):
        await generate(policy, hostile, lambda h: send_json(h, reply))


@pytest.mark.slow
@pytest.mark.parametrize("declared", [True, False], ids=["with-length", "streamed"])
async def test_a_300_mb_reply_is_refused_without_being_read(policy, hostile, declared) -> None:
    with pytest.raises(PolicyError, match=r"bytes; (a reply may hold at most|stopped reading there)"):
        await generate(
            policy, hostile, stream_huge(hostile, completion([1], [-0.5], text="@"), declared=declared)
        )
    time.sleep(0.2)  # the server's last write ends once the client has hung up
    assert hostile.sent < 100 * 2**20, f"the policy read {hostile.sent / 2**20:.0f} MB of a 300 MB reply"


@pytest.mark.slow
async def test_a_dripped_reply_times_out_at_the_deadline(policy, hostile) -> None:
    start = time.monotonic()
    with pytest.raises(PolicyError, match=r"did not answer /v1/completions \(TimeoutError"):
        await generate(policy, hostile, drip)
    assert time.monotonic() - start < TIMEOUT_S + 1.5, "the deadline bounds the whole reply, not each read"


async def test_a_prompt_logprob_that_is_nan_is_refused(policy, hostile) -> None:
    ids = prompt(policy)[:3]
    steps = [None, {str(ids[1]): {"logprob": -1.0}}, {str(ids[2]): {"logprob": float("nan")}}]
    hostile.answer = lambda h: send_json(h, {"choices": [{"prompt_logprobs": steps}]})
    with pytest.raises(PolicyError, match=r"prompt logprob nan at position 1"):
        await policy.score(ids)


async def test_a_hostile_reply_makes_the_episode_an_infra_error(policy, hostile) -> None:
    from toolgym.agents.harness import get_harness
    from toolgym.agents.rollout import run_episode
    from toolgym.registry import make

    hostile.answer = lambda h: send_json(h, completion([1, 2], [-0.5, float("nan")]))
    env = make("toolgym/SearchQA-v0", split="test", max_turns=1)
    try:
        trajectory = await run_episode(env, policy, get_harness("bare"), seed=0)
    finally:
        env.close()
    assert trajectory.status == "infra_error"
    assert not any(trajectory.loss_mask), "nothing of the refused reply is trained on"


# ----------------------------------------------------------------- the OpenAI-compatible HTTP policy
def http_policy(hostile: Hostile) -> HTTPPolicy:
    return HTTPPolicy(f"{hostile.url}/v1", "m", retries=0, timeout_s=TIMEOUT_S)


def chat(text: str, completion_tokens: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {
        "choices": [{"message": message, "finish_reason": "stop"}],
        "usage": {"completion_tokens": completion_tokens},
    }


async def http_generate(hostile: Hostile, answer: Answer) -> Any:
    hostile.answer = answer
    policy = http_policy(hostile)
    return await asyncio.wait_for(
        policy.generate(policy.render([{"role": "user", "content": "hi"}]), SAMPLING), 30
    )


async def test_the_http_policy_takes_an_honest_reply(hostile) -> None:
    done = await http_generate(hostile, lambda h: send_json(h, chat("hello", 2)))
    assert done.text == "hello"


async def test_the_http_policy_refuses_more_tokens_than_asked_for(hostile) -> None:
    with pytest.raises(PolicyError, match=r"answered 5000 completion tokens for a request of max_tokens=8"):
        await http_generate(hostile, lambda h: send_json(h, chat("word " * 5000, 5000)))


async def test_the_http_policy_refuses_a_turn_that_is_not_text(hostile) -> None:
    with pytest.raises(PolicyError, match=r"a chat turn that is not text"):
        await http_generate(hostile, lambda h: send_json(h, chat(12345, 1)))  # type: ignore[arg-type]


@pytest.mark.slow
async def test_the_http_policy_stops_reading_a_300_mb_reply(hostile) -> None:
    with pytest.raises(PolicyError, match=r"stopped reading there"):
        await http_generate(hostile, stream_huge(hostile, chat("@", 1), declared=False))
    time.sleep(0.2)
    assert hostile.sent < 100 * 2**20, f"the policy read {hostile.sent / 2**20:.0f} MB of a 300 MB reply"


@pytest.mark.slow
async def test_the_http_policy_times_out_a_dripped_reply_at_the_deadline(hostile) -> None:
    start = time.monotonic()
    with pytest.raises(PolicyError, match=r"failed after 1 tries; last error: TimeoutError"):
        await http_generate(hostile, drip)
    assert time.monotonic() - start < TIMEOUT_S + 1.5, "the deadline bounds the whole reply, not each read"
