"""TRL: a toolgym environment as GRPOTrainer's ``environment_factory``, checked against the golden
trace and trained for one real step on the embedded model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from golden import golden_path
from transformers.utils import get_json_schema

from toolgym.interop.trl import trl_dataset, trl_environment
from toolgym.registry import make

IDS = [
    "toolgym/SearchQA-v0",
    "toolgym/ArxivRefs-v0",
    pytest.param("toolgym/CodeExec-v0", marks=pytest.mark.docker),
]


@pytest.mark.parametrize("env_id", IDS)
def test_tool_methods_carry_the_environments_schemas(env_id: str) -> None:
    env = make(env_id)
    _, info = env.reset(seed=0)
    env.close()
    instance = trl_environment(env_id)()
    for tool in info["tools"]:
        want = tool["function"]
        got = get_json_schema(getattr(instance, want["name"]))["function"]  # what TRL shows the model
        assert got["name"] == want["name"] and got["description"] == want["description"]
        params = want["parameters"]
        assert got["parameters"].get("required", []) == params.get("required", [])
        assert {k: v["type"] for k, v in got["parameters"]["properties"].items()} == {
            k: v["type"] for k, v in params["properties"].items()
        }


def test_tool_methods_replay_the_golden_trace() -> None:
    episodes = json.loads(golden_path("toolgym/SearchQA-v0").read_text())
    cls = trl_environment("toolgym/SearchQA-v0")
    compared = 0
    for episode in episodes:
        env = cls()
        env.reset(task_id=episode["reset"]["info"]["task_id"], seed=episode["seed"], prompt=[])
        if "tools" in episode["options"]:
            continue  # a restricted tool set has no TRL form (every method is always offered)
        for step in episode["steps"]:
            try:
                call = json.loads(step["action"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
            except json.JSONDecodeError:
                continue  # malformed calls and plain text never reach a tool method
            if not hasattr(env, call["name"]) or not isinstance(call["arguments"].get("query", ""), str):
                continue  # an unknown tool or a wrongly typed argument is TRL's to refuse
            out = getattr(env, call["name"])(**call["arguments"])
            if step["observation"]:
                want = step["observation"][0]["content"]
                note = "\nThe turn budget is spent: the episode is over." if step["truncated"] else ""
                assert out == want + note
            compared += 1
            if step["terminated"] or step["truncated"]:
                assert env.get_reward() == step["reward"]
        env._env.close()
    assert compared >= 8


def test_dataset_rows_are_the_tasks() -> None:
    rows = trl_dataset("toolgym/SearchQA-v0", {"split": "test"}, limit=3)
    env = make("toolgym/SearchQA-v0", split="test")
    tasks = env.unwrapped.tasks[:3]
    env.close()
    assert rows["task_id"] == [t.id for t in tasks]
    assert rows["prompt"] == [[{"role": "user", "content": t.prompt}] for t in tasks]


@pytest.mark.model
@pytest.mark.slow
def test_grpo_trainer_trains_one_step_on_a_toolgym_environment(tmp_path: Path) -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    from toolgym.agents.policies.models import smollm2_path

    seen: list[str | None] = []
    base = trl_environment("toolgym/SearchQA-v0")

    class SearchQA(base):  # type: ignore[misc, valid-type]
        def reset(self, **row):
            seen.append(row.get("task_id"))
            return super().reset(**row)

    model = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = qwen2_5_chat_template  # ChatML with Hermes tool calls, as SmolLM2 speaks
    tokenizer = add_response_schema(tokenizer)
    tokenizer.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=24,
        max_tool_calling_iterations=2,
        learning_rate=1e-6,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        bf16=False,
    )
    dataset = trl_dataset("toolgym/SearchQA-v0", limit=4)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=dataset,
        environment_factory=SearchQA,
    )
    assert sorted(t.__name__ for t in trainer.tools) == ["answer", "open", "search"]
    trainer.train()
    assert trainer.state.global_step == 1
    assert seen and set(seen) <= set(dataset["task_id"])
    logged = trainer.state.log_history[0]
    assert "rewards/SearchQA/mean" in logged and 0.0 <= logged["reward"] <= 1.0
