"""What a step draws and trains on: dynamic sampling, steps without signal, reproducible runs, the
held-out curve, task selection, and progress lines in a log."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides, trajectory

from toolgym.errors import ConfigError
from toolgym.training.config import load_config
from toolgym.training.progress import RunProgress
from toolgym.training.sampling.task_filter import PassRateFilter
from toolgym.training.trainer import Trainer


async def _run(tmp_path: Path, overrides: list[str]) -> tuple[Trainer, list[dict[str, float]]]:
    trainer = Trainer(load_config(None, overrides), tmp_path)
    try:
        return trainer, await trainer.run()
    finally:
        trainer.close()


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]


async def test_dynamic_sampling_trains_only_informative_groups(tmp_path: Path) -> None:
    overrides = [
        *tiny_overrides(steps=3, tasks_per_step=2, group_size=4),
        "env.kwargs={ n_tasks = 2, flat_tasks = 4 }",
        "train.dynamic_sampling=true",
        "train.max_groups_per_step=8",
    ]
    _, history = await _run(tmp_path, overrides)
    records = _records(tmp_path)
    dropped = [r for r in records if r.get("dropped")]
    assert dropped and all(r["dropped"] == "zero_variance" and not r["trained"] for r in dropped)
    assert all(r["trajectory"]["task_id"].startswith("f") for r in dropped)  # the flat tasks
    trained = [r for r in records if r["trained"]]
    assert trained and all(r["trajectory"]["task_id"].startswith("w") for r in trained)
    for m in history:
        assert m["groups/drawn"] <= 8 and m["groups/zero_variance"] == 0.0
        assert m["groups/informative"] >= 2 or m["groups/drawn"] == 8
        assert m["groups/dropped_zero_variance"] == m["groups/drawn"] - m["groups/informative"]
    assert sum(m["groups/dropped_zero_variance"] for m in history) == len(dropped) / 4


async def test_a_step_without_any_informative_group_takes_no_update(tmp_path: Path, caplog) -> None:
    overrides = [
        *tiny_overrides(steps=2, tasks_per_step=2, group_size=2),
        "env.kwargs={ n_tasks = 0, flat_tasks = 3 }",
        "train.dynamic_sampling=true",
        "train.max_groups_per_step=3",
    ]
    trainer = Trainer(load_config(None, overrides), tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    try:
        history = await trainer.run()
    finally:
        trainer.close()
    assert [m["train/updated"] for m in history] == [0.0, 0.0]  # the run went on, to its last step
    assert [m["groups/drawn"] for m in history] == [3.0, 3.0] and all(m["loss/tokens"] == 0 for m in history)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert "none of the 3 groups drawn had reward variance" in caplog.text
    assert trainer.policy.policy_version == 0  # nothing was published


def _comparable(run_dir: Path) -> tuple[list[dict], list[dict]]:
    metrics = [
        {k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    records = []
    for r in _records(run_dir):
        r["trajectory"].pop("timings")
        records.append(r)
    return metrics, records


@pytest.mark.slow
async def test_two_runs_of_one_config_sample_and_train_identically(tmp_path: Path) -> None:
    # look-ahead, several workers and a tool with latency: scheduling varies, the run must not
    overrides = [
        *tiny_overrides(steps=4, tasks_per_step=2, group_size=3),
        "env.kwargs={ latency = 0.01 }",
        "train.rollouts.max_off_policy_steps=1",
        "train.rollouts.workers=3",
        "train.dynamic_sampling=true",
    ]
    runs = []
    for name in ("a", "b"):
        trainer, _ = await _run(tmp_path / name, overrides)
        runs.append((_comparable(tmp_path / name), [p.detach().clone() for p in trainer.model.parameters()]))
    (first, weights_a), (second, weights_b) = runs
    assert first[0] == second[0]  # every metric of every step
    assert first[1] == second[1]  # every trajectory: tokens, logprobs, rewards, advantages
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))
    assert max(m["staleness/max"] for m in first[0]) == 1.0  # look-ahead really sampled ahead


async def test_the_heldout_curve_evaluates_the_training_policy_on_the_test_split(tmp_path: Path) -> None:
    overrides = [
        "env.id=toy_env:toolgym-test/Target-v0",
        "policy.kind=tiny",
        "policy.hidden=32",
        "sampling.max_tokens=6",
        "train.steps=4",
        "train.tasks_per_step=1",
        "train.group_size=2",
        "train.rollouts.max_off_policy_steps=0",
        'env.kwargs={ split = "train" }',
        "heldout.every=2",
        "heldout.curve_n=3",
        'heldout.curve_harnesses=["bare"]',
        "heldout.max_tokens=6",
    ]
    _, history = await _run(tmp_path, overrides)
    curve = [json.loads(line) for line in (tmp_path / "heldout_curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0.0, 2.0, 4.0]
    assert all("heldout_curve/bare/reward" in p for p in curve)
    assert [("heldout_curve/bare/reward" in m) for m in history] == [False, True, False, True]
    episodes = (
        (tmp_path / "heldout_curve" / "step-000002" / "trajectories-bare.jsonl").read_text().splitlines()
    )
    tasks = {json.loads(line)["task_id"] for line in episodes}
    assert len(episodes) == 3 and all(t.startswith("test-") for t in tasks)  # never a training task


def test_the_pass_rate_filter_skips_a_settled_task_once() -> None:
    flat = [trajectory([1, 2], [0, 1], reward=0.0), trajectory([1, 3], [0, 1], reward=0.0)]
    varied = [trajectory([1, 2], [0, 1], reward=0.0), trajectory([1, 3], [0, 1], reward=1.0)]
    f = PassRateFilter()
    f.observe([("a", flat), ("b", varied)])
    assert f.skip("a") and not f.skip("a") and not f.skip("b") and not f.skip("never-seen")
    state = f.state_dict()
    g = PassRateFilter()
    g.load_state_dict(state)
    assert g.metrics() == f.metrics() == {"task_filter/skipped": 1.0, "task_filter/settled_share": 0.0}


async def test_a_run_with_the_pass_rate_filter_skips_tasks_it_settled(tmp_path: Path) -> None:
    overrides = [
        *tiny_overrides(steps=4, tasks_per_step=2, group_size=2),
        "env.kwargs={ n_tasks = 1, flat_tasks = 1 }",
        "train.task_filter=pass_rate",
    ]
    _, history = await _run(tmp_path, overrides)
    assert history[-1]["task_filter/skipped"] >= 1.0
    flat_groups = {r["group"] for r in _records(tmp_path) if r["trajectory"]["task_id"] == "f0"}
    assert len(flat_groups) < 4  # without the filter the flat task comes back every epoch (4 times)


def test_the_reference_pool_needs_a_reference_rule() -> None:
    import asyncio

    from toolgym.training.sampling.task_filter import reference_pool

    with pytest.raises(ConfigError, match="train.task_pool = 'reference': .* has no reference rule"):
        asyncio.run(
            reference_pool(
                "toy_env:toolgym-test/Letters-v0",
                {},
                ["w0"],
                min_reward=0.5,
                max_tokens=8,
                max_total_tokens=512,
            )
        )


def test_progress_prints_lines_when_not_on_a_terminal(monkeypatch) -> None:
    import toolgym.training.progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    progress = RunProgress(out)
    assert not progress.terminal
    with progress.task("warm start", total=20) as bar:
        for i in range(1, 21):
            clock[0] += 1.5  # a tenth every 3 s
            bar.update(i)
    with progress.task("reference episodes", total=64) as bar:
        for i in range(1, 65):  # all within a second: its start and its end
            clock[0] += 0.01
            bar.update(i)
    with progress.task("training", total=2) as bar:
        bar.update(1, note="reward 0.100")
    with progress.task("training", total=18, completed=18):
        pass
    lines = out.getvalue().splitlines()
    assert any("warm start: started (20 to do)" in x for x in lines)
    assert any("training: started (18 of 18 done, 0 to do)" in x for x in lines)  # a resumed run
    assert sum("warm start: " in x and "/20" in x for x in lines) == 10  # one line per tenth
    shown = [x.split("] ", 1)[1] for x in lines if "reference episodes" in x]
    assert shown == ["reference episodes: started (64 to do)", "reference episodes: 64/64 (100.00 per s)"]
    assert any("training: 1/2 reward 0.100" in x for x in lines)
    quiet = io.StringIO()
    RunProgress(quiet, terminal=True).line("nothing")
    assert quiet.getvalue() == ""
    RunProgress(quiet, terminal=True).warn("left out")  # a warning is shown on a terminal too
    assert quiet.getvalue().rstrip().endswith("WARNING: left out")


def test_the_reference_rule_is_named_by_the_environment_or_chosen_by_name() -> None:
    """SearchQA names the reformulating rule for its hard questions (the copy rule solves 0.6 % of
    them), the copy rule otherwise; ``env.reference_rule`` chooses; an unknown name is refused with the
    ones that exist; a module with only ``reference_rule`` has that one."""
    from toolgym.envs.search_qa import reference_rule, reformulating_rule
    from toolgym.registry import env_reference_rule

    search = "toolgym/SearchQA-v0"
    assert env_reference_rule(search, {}) == ("copy", reference_rule)
    assert env_reference_rule(search, {"questions": "hard"}) == ("reformulate", reformulating_rule)
    assert env_reference_rule(search, {"questions": "hard"}, "copy") == ("copy", reference_rule)
    with pytest.raises(
        ConfigError,
        match=r"no such reference rule\. Did you mean 'reformulate'\? Its rules: copy, reformulate",
    ):
        env_reference_rule(search, {}, "reformulat")
    assert env_reference_rule("toolgym/ArxivRefs-v0", {})[0] == "reference"


def test_the_hard_questions_reference_pool_is_the_reformulating_rules() -> None:
    """On hard questions the default rule's pool holds every task; the copy rule's holds almost none."""
    import asyncio

    import gymnasium

    from toolgym.training.sampling.task_filter import reference_pool

    kwargs = {"questions": "hard", "split": "train"}
    env = gymnasium.make("toolgym/SearchQA-v0", **kwargs)
    ids = [t.id for t in env.unwrapped.tasks[:12]]
    env.close()

    def pool(rule: str) -> list[str]:
        return asyncio.run(
            reference_pool(
                "toolgym/SearchQA-v0",
                kwargs,
                ids,
                rule=rule,
                min_reward=0.5,
                max_tokens=2048,
                max_total_tokens=1 << 17,
            )
        )

    assert pool("") == ids
    with pytest.raises(ConfigError, match="solves none of the 12 training tasks"):
        pool("copy")


def test_shuffled_references_are_a_seeded_permutation_with_no_fixed_point() -> None:
    from toolgym.training.sampling.reward_control import shuffled_references

    ids = [f"t{i}" for i in range(50)]
    mapping = shuffled_references(ids, seed=0)
    assert sorted(mapping) == sorted(mapping.values()) == sorted(ids)  # a permutation
    assert all(k != v for k, v in mapping.items())  # no task scored against its own reference
    assert mapping == shuffled_references(list(reversed(ids)), seed=0)  # the order given does not matter
    assert mapping != shuffled_references(ids, seed=1)
    assert shuffled_references(["a", "b"], seed=3) == {"a": "b", "b": "a"}
    with pytest.raises(ConfigError, match="needs two or more training tasks"):
        shuffled_references(["only"], seed=0)


def test_an_episode_scored_as_another_task_gets_that_tasks_reward() -> None:
    """The environment's ``score_as`` reset option: the episode is task A's, its reward B's reference's."""
    import gymnasium

    import toolgym  # noqa: F401
    from toolgym.parsing import format_tool_call

    env = gymnasium.make("toolgym/SearchQA-v0", split="test")
    try:
        a, b = env.unwrapped.tasks[:2]
        answer = format_tool_call("answer", {"answer": a.reference[0]})
        env.reset(seed=0, options={"task_id": a.id})
        assert env.step(answer)[1] == 1.0
        obs, _ = env.reset(seed=0, options={"task_id": a.id, "score_as": b.id})
        assert a.metadata["question"] in obs[-1]["content"]  # still task A's episode
        assert env.step(answer)[1] < 1.0
        env.reset(seed=0, options={"task_id": a.id, "score_as": b.id})
        assert env.step(format_tool_call("answer", {"answer": b.reference[0]}))[1] == 1.0
        with pytest.raises(ConfigError, match="score_as = 'nope' is not a task"):
            env.reset(seed=0, options={"task_id": a.id, "score_as": "nope"})
    finally:
        env.close()


async def test_a_shuffled_rewards_run_scores_each_task_against_another(tmp_path: Path) -> None:
    """``train.reward_control = "shuffled"`` on two tasks: the word task is scored as the flat task (0.5
    whatever it answers), the flat task by the letters rule; a run of one task is refused at start."""
    overrides = [
        *tiny_overrides(steps=2, tasks_per_step=2, group_size=2),
        "env.kwargs={ n_tasks = 1, flat_tasks = 1 }",
        "train.reward_control=shuffled",
    ]
    await _run(tmp_path / "run", overrides)
    rewards: dict[str, set[float]] = {}
    for r in _records(tmp_path / "run"):
        rewards.setdefault(r["trajectory"]["task_id"], set()).add(r["trajectory"]["reward"])
    assert rewards["w0"] == {0.5}, rewards  # scored against f0's reference
    assert rewards["f0"] != {0.5}, rewards  # scored by the letters share of its answers
    with pytest.raises(ConfigError, match="needs two or more training tasks"):
        Trainer(
            load_config(
                None, [*overrides[:-2], "env.kwargs={ n_tasks = 1 }", "train.reward_control=shuffled"]
            ),
            tmp_path / "one",
        )


def test_a_long_phase_prints_a_line_every_30_seconds_between_tenths(monkeypatch) -> None:
    import toolgym.training.progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    with RunProgress(out).task("held-out trained", total=1000) as bar:
        bar.update(0, total=1000)
        for done in (1, 2, 3):  # far from a tenth: a line only once 30 s have passed
            clock[0] += 20.0
            bar.update(done)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("held-out trained: started (1000 to do)")
    assert lines[1].endswith("held-out trained: 2/1000 (0.05 per s)")  # 2 episodes in 40 s
