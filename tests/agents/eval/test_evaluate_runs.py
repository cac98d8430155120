"""Evaluation run directories on the real SearchQA env: record, resume, refusal, paired comparison.

Policies are model-free rules (an oracle that answers the gold answer, one that always answers
wrong), so rewards are known exactly and the tests take seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium
import pytest

import toolgym  # noqa: F401  (registers the environments)
from toolgym.agents.eval.evaluate import evaluate
from toolgym.agents.eval.runs import compare_runs, load_eval_run
from toolgym.agents.policies.base import RulePolicy
from toolgym.errors import ConfigError

ENV = "toolgym/SearchQA-v0"


class Crash(Exception):
    pass


def _gold() -> dict[str, str]:
    env = gymnasium.make(ENV)
    try:
        return {t.prompt: t.reference[0] for t in env.unwrapped.tasks}
    finally:
        env.close()


GOLD = _gold()


def oracle(calls: list[int] | None = None, crash_after: int | None = None):
    """Answers each question with its gold answer (reward 1); counts calls; may crash after N calls."""

    def rule(transcript: str) -> str:
        if calls is not None:
            calls.append(1)
            if crash_after is not None and len(calls) > crash_after:
                raise Crash("the machine went away")
        question = next(q for q in GOLD if q in transcript.rsplit("<|im_start|>user", 1)[-1])
        return f"<answer>{GOLD[question]}</answer>"

    return lambda: RulePolicy(rule, name="oracle")


def wrong():
    return RulePolicy(lambda _: "<answer>zzzz</answer>", name="wrong")


async def run(out: Path | None, factory, *, seed: int = 0, n: int = 4, label: str = "oracle", **kwargs):
    return await evaluate(
        ENV,
        factory,
        ("bare", "scaffold"),
        n=n,
        seed=seed,
        concurrency=1,
        out_dir=out,
        policy_label=label,
        **kwargs,
    )


async def test_eval_json_records_settings_and_summaries(tmp_path):
    report = await run(tmp_path, oracle(), seed=5)
    record = json.loads((tmp_path / "eval.json").read_text())
    settings = record["settings"]
    assert record["status"] == "complete" and record["format"] == 1
    assert settings["env_id"] == ENV and settings["env_kwargs"] == {}
    assert settings["harnesses"] == ["bare", "scaffold"]
    assert settings["task_ids"] == report.task_ids and settings["seeds"] == [5, 6, 7, 8]
    assert settings["policy"] == "oracle" and settings["max_total_tokens"] == 8192
    assert settings["sampling"]["max_tokens"] == 96 and settings["sampling"]["temperature"] == 0.0
    assert [t["harness"] for t in record["tracks"]] == ["bare", "scaffold"]
    assert [t["reward"] for t in record["tracks"]] == [1.0, 1.0]


async def test_an_interrupted_eval_resumes_without_rerunning_or_mixing(tmp_path):
    calls: list[int] = []
    with pytest.raises(Crash):
        await run(tmp_path, oracle(calls, crash_after=3))
    assert json.loads((tmp_path / "eval.json").read_text())["status"] == "running"
    assert len((tmp_path / "trajectories-bare.jsonl").read_text().splitlines()) == 3
    with (tmp_path / "trajectories-bare.jsonl").open("a") as fh:
        fh.write('{"env_id": "toolgym/Sea')  # a line torn by the kill
    calls.clear()
    report = await run(tmp_path, oracle(calls))
    assert len(calls) == 1 + 4  # the one missing bare episode, then the whole scaffold track
    reference = await run(None, oracle())
    assert report.task_ids == reference.task_ids
    assert [t.reward for t in report.tracks] == [t.reward for t in reference.tracks] == [1.0, 1.0]
    for harness in ("bare", "scaffold"):
        lines = (tmp_path / f"trajectories-{harness}.jsonl").read_text().splitlines()
        assert sorted(json.loads(x)["task_id"] for x in lines) == sorted(report.task_ids)
    calls.clear()
    await run(tmp_path, oracle(calls))  # a complete run resumed: nothing left to do
    assert calls == []


async def test_other_settings_are_refused_then_restart_clears(tmp_path):
    await run(tmp_path, oracle())
    with pytest.raises(ConfigError) as info:
        await run(tmp_path, oracle(), seed=1)
    message = str(info.value)
    assert "other settings" in message and "seeds (4 vs 4 values; first difference at #0: 0 vs 1)" in message
    assert "task_ids" in message and "--restart" in message
    with pytest.raises(ConfigError, match="policy"):
        await run(tmp_path, wrong, label="wrong")
    report = await run(tmp_path, wrong, label="wrong", restart=True)
    assert [t.reward for t in report.tracks] == [0.0, 0.0]
    assert len((tmp_path / "trajectories-bare.jsonl").read_text().splitlines()) == 4


async def test_trajectories_without_a_record_are_refused(tmp_path):
    (tmp_path / "trajectories-bare.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds trajectories but no eval.json"):
        await run(tmp_path, oracle())


async def test_compare_gives_the_paired_difference_per_track(tmp_path):
    await run(tmp_path / "a", wrong, label="wrong")
    await run(tmp_path / "b", oracle())
    comparison = compare_runs(load_eval_run(tmp_path / "a"), load_eval_run(tmp_path / "b"))
    assert [(t.harness, t.n, t.diff, t.low, t.high) for t in comparison.tracks] == [
        ("bare", 4, 1.0, 1.0, 1.0),
        ("scaffold", 4, 1.0, 1.0, 1.0),
    ]
    assert comparison.notes == ['policy ("wrong" vs "oracle")']


async def test_infra_error_pairs_are_left_out_of_the_comparison(tmp_path):
    await run(tmp_path / "a", wrong, label="wrong")
    await run(tmp_path / "b", oracle())
    path = tmp_path / "b" / "trajectories-bare.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    records[0]["status"] = "infra_error"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    bare = compare_runs(load_eval_run(tmp_path / "a"), load_eval_run(tmp_path / "b")).tracks[0]
    assert (bare.n, bare.infra_dropped) == (3, 1)


@pytest.mark.parametrize(
    ("b_kwargs", "fields"),
    [
        ({"seed": 1}, ["task_ids", "seeds"]),
        ({"n": 3}, ["task_ids (4 vs 3 values", "seeds (4 vs 3 values"]),
        ({"env_kwargs": {"max_turns": 2}}, ['env_kwargs ({} vs {"max_turns": 2})']),
    ],
)
async def test_compare_refuses_runs_of_other_episodes_and_names_the_fields(tmp_path, b_kwargs, fields):
    await run(tmp_path / "a", oracle())
    await run(tmp_path / "b", oracle(), **b_kwargs)
    with pytest.raises(ConfigError) as info:
        compare_runs(load_eval_run(tmp_path / "a"), load_eval_run(tmp_path / "b"))
    assert "cannot compare" in str(info.value)
    for field in fields:
        assert field in str(info.value)


async def test_compare_refuses_an_incomplete_run_and_a_non_eval_dir(tmp_path):
    await run(tmp_path / "a", oracle())
    with pytest.raises(Crash):
        await run(tmp_path / "b", oracle([], crash_after=2))
    with pytest.raises(ConfigError, match=r"incomplete \(2 of 8 episodes\).*resumes"):
        compare_runs(load_eval_run(tmp_path / "a"), load_eval_run(tmp_path / "b"))
    (tmp_path / "c").mkdir()
    with pytest.raises(ConfigError, match="has no eval.json"):
        load_eval_run(tmp_path / "c")


async def test_compare_pairs_the_tool_use_measures(tmp_path):
    """On the hard questions, the reformulating rule against the copy rule: every episode reformulates
    and is shown a gold answer (+1.000 on both), and a measure one side lacks is not compared."""
    from toolgym.core import SamplingParams
    from toolgym.envs.search_qa import reference_rule, reformulating_rule

    kwargs = {"questions": "hard", "split": "test"}
    env = gymnasium.make(ENV, **kwargs)
    by_question = {t.metadata["question"]: t for t in env.unwrapped.tasks}
    env.close()

    def playing(make_rule, name):
        def rule(transcript: str) -> str:
            episode = transcript.rsplit("Question: ", 1)[-1]
            return make_rule(next(t for q, t in by_question.items() if q in episode))(transcript)

        return lambda: RulePolicy(rule, name=name)

    budget = {"env_kwargs": kwargs, "sampling": SamplingParams(max_tokens=2048), "max_total_tokens": 1 << 17}
    await run(tmp_path / "a", playing(reference_rule, "copy"), label="copy", n=6, **budget)
    await run(tmp_path / "b", playing(reformulating_rule, "reformulate"), label="reformulate", n=6, **budget)
    comparison = compare_runs(load_eval_run(tmp_path / "a"), load_eval_run(tmp_path / "b"))
    by = {(m.harness, m.measure): m for m in comparison.tool_use}
    for track in ("bare", "scaffold"):
        for measure in ("use/reformulated", "use/answer_shown"):
            m = by[(track, measure)]
            assert (m.n, m.a, m.b, m.diff, m.low, m.high) == (6, 0.0, 1.0, 1.0, 1.0, 1.0), m
    assert by[("bare", "use/query_overlap")].diff < 0
    assert json.loads(comparison.to_json())["tool_use"][0]["measure"].startswith("use/")
    # the arms tables carry the same rows (the reformulating arm against the copy baseline)
    from toolgym.training.experiments.arms_results import compare_arms, markdown_table, results_dict

    runs = {"copy": load_eval_run(tmp_path / "a"), "reformulate": load_eval_run(tmp_path / "b")}
    results = compare_arms(runs, "copy")
    table = markdown_table(results)
    assert "Tool use (toolgym.tool_use), arm − copy" in table
    assert "| reformulate: bare | reformulated | 0.000 | 1.000 | +1.000 [+1.000, +1.000] |" in table
    assert {m["measure"] for m in results_dict(results)["tool_use"]} >= {
        "use/answer_shown",
        "use/reformulated",
    }


async def test_a_budget_that_ends_every_episode_before_its_first_action_is_refused(tmp_path, caplog):
    """Not a score of 0: the prompt alone filled the token budget, so the model never acted. Every
    episode so: a ConfigError naming the prompt's length and the budget; some: a warning with the count."""
    import logging

    with pytest.raises(
        ConfigError,
        match=r"4 of 4 episodes ended on the token budget before the model's first action: the prompt alone took \d+ tokens .* of the budget of 200",
    ) as refused:
        await run(None, oracle(), n=2, max_total_tokens=200)
    assert str(refused.value).endswith("then run again")  # nothing was kept, nothing to clear
    with pytest.raises(ConfigError, match=r"then run again with --restart$"):  # its episodes were kept
        await run(tmp_path / "out", oracle(), n=2, max_total_tokens=200)
    from toolgym.agents.eval.evaluate import _check_budget
    from toolgym.core import Trajectory

    def episode(starved: bool) -> Trajectory:
        metrics = {"env/no_first_action": 1.0, "env/prompt_tokens": 900.0} if starved else {}
        return Trajectory(
            env_id=ENV,
            task_id="t",
            seed=0,
            harness="bare",
            allowed_tools=(),
            messages=(),
            token_ids=(),
            loss_mask=(),
            logprobs=(),
            reward=0.0,
            metrics=metrics,
            status="truncated",
        )

    with caplog.at_level(logging.WARNING):
        _check_budget({"bare": [episode(True), episode(False), episode(False)]}, 800, recorded=False)
    assert "1 of 3 episodes ended on the token budget before the model's first action" in caplog.text
    assert "took 900 tokens" in caplog.text and "budget of 800" in caplog.text


async def test_the_same_rewards_give_the_same_interval_whatever_order_the_episodes_ended_in(tmp_path):
    """A track's file lists episodes as they end, which concurrency makes vary between runs; loaded,
    they come back in the evaluation's planned order, so the paired bootstrap (which resamples pairs by
    position) gives one interval for one set of rewards."""
    import random
    import shutil

    def half(transcript: str) -> str:  # right on about half of the questions: rewards that differ
        question = next(q for q in GOLD if q in transcript.rsplit("<|im_start|>user", 1)[-1])
        return f"<answer>{GOLD[question] if len(question) % 2 else 'zzzz'}</answer>"

    await run(tmp_path / "a", wrong, label="wrong", n=12)
    await run(tmp_path / "b", lambda: RulePolicy(half, name="half"), n=12)
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    for track in ("bare", "scaffold"):  # the same episodes, ended in another order
        file = tmp_path / "c" / f"trajectories-{track}.jsonl"
        lines = file.read_text().splitlines()
        random.Random(1).shuffle(lines)
        file.write_text("\n".join(lines) + "\n")
    b, c = load_eval_run(tmp_path / "b"), load_eval_run(tmp_path / "c")
    assert (tmp_path / "b" / "trajectories-bare.jsonl").read_text() != (
        tmp_path / "c" / "trajectories-bare.jsonl"
    ).read_text()
    planned = list(zip(b.settings.task_ids, b.settings.seeds, strict=True))
    assert [(t.task_id, t.seed) for t in c.trajectories["bare"]] == planned
    a = load_eval_run(tmp_path / "a")
    ours, theirs = compare_runs(a, b), compare_runs(a, c)
    rows = [(t.harness, t.diff, t.low, t.high) for t in ours.tracks]
    assert rows == [(t.harness, t.diff, t.low, t.high) for t in theirs.tracks]
    assert any(low < high for _, _, low, high in rows), "the rewards differ: the interval has width"
    assert (ours.pooled.low, ours.pooled.high) == (theirs.pooled.low, theirs.pooled.high)
