"""``toolgym serve`` and ``ServedEnv``: sessions, limits, auth, reaping and every failure's meaning."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium
import httpx
import pytest

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import FunctionTool, Message, Score, Task, Tool
from toolgym.env import ToolEnv
from toolgym.errors import ConfigError, InfraError, VerifierError
from toolgym.registry import make
from toolgym.serving.client import ServedEnv
from toolgym.serving.server import MAX_ACTION_CHARS, serve_command
from toolgym.training.config import load_config
from toolgym.training.trainer import Trainer

SEARCH = "toolgym/SearchQA-v0"
ANSWER = '<tool_call>{"name": "answer", "arguments": {"answer": "308"}}</tool_call>'
SEARCH_CALL = '<tool_call>{"name": "search", "arguments": {"query": "Panthers defense"}}</tool_call>'


def wait_until(predicate: Any, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


async def test_episodes_over_the_wire_are_token_identical_to_in_process(serve) -> None:
    turns = [SEARCH_CALL, ANSWER]
    options = {"task_index": 0}
    native = await run_episode(
        make(SEARCH), ScriptedPolicy(turns), get_harness("scaffold"), seed=4, options=options
    )
    with serve(SEARCH) as (url, server):
        env = make(url)
        remote = await run_episode(
            env, ScriptedPolicy(turns), get_harness("scaffold"), seed=4, options=options, env_id=SEARCH
        )
        await env.aclose()
        assert not server.sessions
    assert remote.reward == native.reward == 1.0
    assert remote.token_ids == native.token_ids and remote.loss_mask == native.loss_mask
    assert remote.messages == native.messages and remote.token_hash == native.token_hash
    assert isinstance(env, gymnasium.Env) and env.task_ids()[:1] == make(SEARCH).unwrapped.task_ids()[:1]


def test_bad_requests_get_clear_statuses(serve) -> None:
    with serve(SEARCH) as (url, _), httpx.Client(base_url=url) as http:
        assert http.get("/health").json()["status"] == "ok"
        bad = http.post("/sessions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and "not JSON" in bad.json()["error"]["message"]
        assert http.post("/sessions", json=[1, 2]).status_code == 400
        assert (
            "seed must be a non-negative integer"
            in http.post("/sessions", json={"seed": "x"}).json()["error"]["message"]
        )
        unknown = http.post("/sessions", json={"options": {"task_id": "nope"}})
        assert unknown.status_code == 400 and unknown.json()["error"]["type"] == "ConfigError"
        missing = http.post("/sessions/abc/step", json={"action": "hi"})
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "UnknownSession"
        assert http.delete("/sessions/abc").status_code == 404
        sid = http.post("/sessions", json={"seed": 0, "options": {"task_index": 0}}).json()["session"]
        assert http.post(f"/sessions/{sid}/step", json={"action": 5}).status_code == 400
        huge = http.post(f"/sessions/{sid}/step", json={"action": "x" * (MAX_ACTION_CHARS + 1)})
        assert huge.status_code == 400 and "characters" in huge.json()["error"]["message"]
        done = http.post(f"/sessions/{sid}/step", json={"action": ANSWER}).json()
        assert done["terminated"] and done["reward"] == 1.0
        after = http.post(f"/sessions/{sid}/step", json={"action": ANSWER})
        assert after.status_code == 400 and "episode is over" in after.json()["error"]["message"]
        assert http.delete(f"/sessions/{sid}").status_code == 204


def test_a_full_server_refuses_instead_of_slowing_down(serve) -> None:
    with serve(SEARCH, max_sessions=2) as (url, server):
        envs = [ServedEnv(url) for _ in range(3)]
        for env in envs[:2]:
            env.reset(seed=0)
        with pytest.raises(InfraError, match="maximum of 2 sessions"):
            envs[2].reset(seed=0)
        full = httpx.post(f"{url}/sessions", json={})
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        envs[0].close()  # a freed slot is usable again
        envs[2].reset(seed=0)
        assert len(server.sessions) == 2
        for env in envs:
            env.close()
        assert not server.sessions


def test_a_token_guards_every_route_but_health(serve, monkeypatch: pytest.MonkeyPatch) -> None:
    with serve(SEARCH, token="s3cret") as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/info").status_code == 401
        assert httpx.get(f"{url}/info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        with pytest.raises(ConfigError, match="TOOLGYM_SERVE_TOKEN"):
            ServedEnv(url)
        ServedEnv(url, token="s3cret").close()
        monkeypatch.setenv("TOOLGYM_SERVE_TOKEN", "s3cret")
        env = make(url)
        env.reset(seed=0)
        env.close()


def test_binding_beyond_loopback_without_a_token_is_refused() -> None:
    with pytest.raises(ConfigError, match="without a bearer token"):
        serve_command(SEARCH, {}, host="0.0.0.0")
    with pytest.raises(ConfigError, match="unknown environment id"):
        serve_command("toolgym/SerchQA-v0", {}, host="127.0.0.1")


def test_a_client_that_disappears_is_reaped(serve) -> None:
    with serve(SEARCH, session_timeout=0.3, reap_every=0.05) as (url, server):
        env = ServedEnv(url)
        env.reset(seed=0)
        assert len(server.sessions) == 1
        wait_until(lambda: not server.sessions)
        with pytest.raises(InfraError, match="UnknownSession|no session"):
            env.step(ANSWER)
        env.reset(seed=0)  # a new episode works
        env.close()


async def test_a_server_that_dies_is_an_infra_error(serve) -> None:
    with serve(SEARCH) as (url, _):
        env = make(url)
        env.reset(seed=0, options={"task_index": 0})
    with pytest.raises(InfraError, match="unreachable"):
        env.step(SEARCH_CALL)
    trajectory = await run_episode(env, ScriptedPolicy([ANSWER]), get_harness("bare"), seed=0, env_id=SEARCH)
    assert trajectory.status == "infra_error" and "unreachable" in trajectory.error
    with pytest.raises(InfraError):
        ServedEnv(url)


class BuggyVerifier:
    def score(self, task: Task, answer: object, trajectory: Sequence[Message]) -> Score:
        raise VerifierError("the reference file is corrupt")


class BuggyEnv(ToolEnv):
    description = "A verifier with a bug (tests only)."

    def __init__(self) -> None:
        super().__init__(max_turns=2)
        self.tasks = [Task(id="t0", prompt="Say hi.", reference="hi")]
        self.verifier = BuggyVerifier()

    async def episode_tools(self, task: Task) -> Sequence[Tool]:
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        return [FunctionTool("answer", "Answer.", schema, terminal=True)]


gymnasium.register(id="toolgym-test/Buggy-v0", entry_point=BuggyEnv)


async def test_a_verifier_bug_crosses_the_wire_as_itself(serve) -> None:
    with serve("toolgym-test/Buggy-v0") as (url, _):
        env = make(url)
        env.reset(seed=0)
        with pytest.raises(VerifierError, match="reference file is corrupt"):
            env.step(ANSWER)
        with pytest.raises(VerifierError):  # never an infra_error trajectory, never reward 0
            await run_episode(env, ScriptedPolicy([ANSWER]), get_harness("bare"), seed=0)
        await env.aclose()


def test_remote_env_checks_its_address() -> None:
    with pytest.raises(ConfigError, match="http://"):
        ServedEnv("localhost:8765")
    with pytest.raises(ConfigError, match="http://"):
        ServedEnv("ftp://example.org")
    with pytest.raises(InfraError, match="unreachable"):
        ServedEnv("http://127.0.0.1:9")  # nothing listens on the discard port


@pytest.mark.docker
def test_a_vanished_code_client_leaves_no_container(serve) -> None:
    import docker

    with serve("toolgym/CodeExec-v0", session_timeout=0.5, reap_every=0.1) as (url, server):
        with httpx.Client(base_url=url, timeout=120) as http:
            sid = http.post("/sessions", json={"seed": 0, "options": {"task_id": "HumanEval/0"}}).json()[
                "session"
            ]
            code = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
            step = http.post(f"/sessions/{sid}/step", json={"action": code}).json()
            assert step["observation"][0]["content"].strip() == "42"
            container = server.sessions[sid].env.unwrapped._session._box.container.id
        client = docker.from_env()
        assert client.containers.get(container).status == "running"
        wait_until(lambda: not server.sessions)  # the client never came back

        def gone() -> bool:
            try:
                client.containers.get(container)
            except docker.errors.NotFound:
                return True
            return False

        wait_until(gone, seconds=60)


async def test_the_trainer_trains_on_a_served_environment(serve, tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))  # toy_env.py
    with serve("toy_env:toolgym-test/Letters-v0") as (url, server):
        overrides = [f"env.id={url}", "policy.kind=tiny", "policy.hidden=32", "sampling.max_tokens=8"]
        config = load_config(None, [*overrides, "train.steps=2", "train.rollouts.max_off_policy_steps=0"])
        trainer = Trainer(config, tmp_path)
        try:
            history = await trainer.run()
        finally:
            trainer.close()
        assert [m["step"] for m in history] == [1.0, 2.0]
        samples = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
        assert len(samples) == 2 * 2 * 4 and all(s["trajectory"]["status"] == "ok" for s in samples)
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        assert manifest["env"]["provenance"]["served"]["id"] == "toy_env:toolgym-test/Letters-v0"
    assert not server.sessions
