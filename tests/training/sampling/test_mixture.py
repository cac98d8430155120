"""Training on a mixture of environments: the config's [[env]] tables, the sampler's draws and signals."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.training.config import MixtureConfig, load_config
from toolgym.training.learn.grpo import plan_step
from toolgym.training.sampling.mixture import MixtureSampler, env_metrics
from toolgym.training.sampling.workers import GroupSampler

TWO = """
[[env]]
id = "toolgym/SearchQA-v0"
kwargs = { split = "train" }
stages = [["answer"], ["answer", "search"]]

[[env]]
id = "toolgym/CodeExec-v0"
name = "code"
weight = 0.5
max_total_tokens = 1024
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mix.toml"
    path.write_text(text)
    return path


def traj(reward: float, task: str = "t", status: str = "ok") -> Trajectory:
    return Trajectory(
        env_id="e",
        task_id=task,
        seed=0,
        harness="bare",
        allowed_tools=(),
        messages=(),
        token_ids=(1, 2),
        loss_mask=(0, 1),
        logprobs=(0.0, -1.0),
        reward=reward,
        metrics={"env/turns": 1.0},
        status=status,
        policy_version=0,
    )


def test_env_tables_make_a_mixture_and_overrides_address_one_by_position(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO), ["env.1.weight=2", "env.0.kwargs.max_turns=3", "heldout.n=0"])
    assert config.is_mixture and [e.name for e in config.envs] == ["SearchQA-v0", "code"]
    assert [e.weight for e in config.envs] == [1.0, 2.0] and config.env is config.envs[0]
    assert config.envs[0].kwargs == {"split": "train", "max_turns": 3}
    assert (
        config.envs[0].stages == (("answer",), ("answer", "search"))
        and config.envs[1].max_total_tokens == 1024
    )
    single = load_config(None, ["env.kwargs.max_turns=2"])
    assert not single.is_mixture and single.envs == (single.env,)


@pytest.mark.parametrize(
    ("extra", "overrides", "message"),
    [
        (
            "",
            ["env.1.weight=0"],
            r"env 'code': weight must be a positive number, got 0.0.*leave the environment out",
        ),
        ("", ["env.0.weight=-1"], r"weight must be a positive number, got -1.0"),
        ("", ["env.1.name=SearchQA-v0"], r"names must differ, 'SearchQA-v0' is used twice"),
        (
            "",
            ["env.kwargs.split=test"],
            r"env is a list of 2 tables; address one by its position, e.g. env.0.kwargs",
        ),
        ("", ["env.2.weight=1"], r"env is a list of 2 tables"),
        ('[curriculum]\nstages = [["answer"]]\n', [], r"each \[\[env\]\] lists its own stages"),
        (
            "[warm_start]\nsamples = 1\n",
            [],
            r"warm_start with several \[\[env\]\] tables is not supported",
        ),
        (
            "[heldout]\nn = 10\nenv = 'cod'\n",
            [],
            r"heldout.env = 'cod' names no environment of this run \('SearchQA-v0', 'code'\). Did you mean 'code'",
        ),
        ("[mixture]\nnormalize = 'zscore'\n", [], r"mixture.normalize must be one of none, std"),
    ],
)
def test_a_wrong_mixture_is_a_clear_error_at_start(
    tmp_path: Path, extra: str, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, TWO + extra), overrides)


def test_an_unknown_environment_in_the_mixture_stops_the_trainer_before_any_model_loads(
    tmp_path: Path,
) -> None:
    from toolgym.training.trainer import Trainer

    config = load_config(write(tmp_path, TWO), ["env.1.id=toolgym/CodeExce-v0", "policy.kind=tiny"])
    with pytest.raises(ConfigError, match=r"unknown environment id 'toolgym/CodeExce-v0'.*CodeExec-v0"):
        Trainer(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_one_environment_draws_exactly_what_the_group_sampler_draws() -> None:
    ids = [f"t{i}" for i in range(7)]
    mixed, plain = (
        MixtureSampler([ids], [3.0], group_size=4, seed=11),
        GroupSampler(ids, group_size=4, seed=11),
    )
    assert [mixed.route(g) for g in range(30)] == [(0, plain.task(g)) for g in range(30)]
    assert mixed.episode_seed(5, 2) == plain.episode_seed(5, 2)


def test_draws_follow_the_weights_and_stay_within_each_environment() -> None:
    sampler = MixtureSampler([["a0", "a1"], ["b0", "b1", "b2"]], [1.0, 3.0], group_size=2, seed=0)
    routes = [sampler.route(g) for g in range(4000)]
    share = Counter(e for e, _ in routes)[1] / len(routes)
    assert 0.72 < share < 0.78  # 3 / (1 + 3)
    assert all(task[0] == "ab"[e] for e, task in routes)
    assert routes == [sampler.route(g) for g in range(4000)]  # a pure function of the index and the weights


def test_adapt_moves_weight_away_from_an_environment_without_reward_variance() -> None:
    sampler = MixtureSampler([["a"], ["b"]], [1.0, 1.0], group_size=2, seed=0, config=MixtureConfig(window=4))
    assert sampler.weights() == [0.5, 0.5]
    flat, varied = [traj(0.0), traj(0.0)], [traj(0.0), traj(1.0)]
    sampler.observe([0, 1, 0, 1], [flat, varied, flat, varied])
    assert sampler.weights() == pytest.approx([0.2, 0.8])  # env 0 keeps its floor: 0.25 of its weight
    assert sampler.metrics(["a", "b"])["mixture/a/zero_variance_share"] == 1.0
    # infra_error samples are never a signal; a later varied window restores the weight
    sampler.observe([0], [[traj(0.0, status="infra_error")]])
    sampler.observe([0] * 4, [varied] * 4)
    assert sampler.weights() == pytest.approx([0.5, 0.5])
    fixed = MixtureSampler(
        [["a"], ["b"]], [1.0, 1.0], group_size=2, seed=0, config=MixtureConfig(adapt=False)
    )
    fixed.observe([0, 0], [flat, flat])
    assert fixed.weights() == [0.5, 0.5]


def test_state_round_trips_and_refuses_another_mixture() -> None:
    config = MixtureConfig(window=3, normalize="std")
    sampler = MixtureSampler([["a"], ["b"]], [1.0, 2.0], group_size=2, seed=1, config=config)
    sampler.observe([0, 1], [[traj(0.0), traj(0.0)], [traj(0.2), traj(0.6)]])
    restored = MixtureSampler([["a"], ["b"]], [1.0, 2.0], group_size=2, seed=1, config=config)
    restored.load_state_dict(sampler.state_dict())
    assert restored.weights() == sampler.weights() and restored.scale(1) == sampler.scale(1)
    assert [restored.route(g) for g in range(50)] == [sampler.route(g) for g in range(50)]
    other = MixtureSampler([["a"], ["b"], ["c"]], [1.0] * 3, group_size=2, seed=1)
    with pytest.raises(ConfigError, match="checkpoint's mixture has 2 environments, the config 3"):
        other.load_state_dict(sampler.state_dict())


def test_std_normalisation_divides_a_groups_advantages_by_its_environments_reward_std() -> None:
    sampler = MixtureSampler(
        [["a"], ["b"]], [1.0, 1.0], group_size=2, seed=0, config=MixtureConfig(normalize="std")
    )
    assert sampler.scale(1) == 1.0  # no history yet
    sampler.observe([1], [[traj(0.2), traj(0.6)]])  # std 0.2
    assert sampler.scale(1) == pytest.approx(5.0) and sampler.scale(0) == 1.0
    group = [traj(0.0), traj(1.0)]
    plain = plan_step([group], normalize_std=False)
    scaled = plan_step([group], normalize_std=False, scales=[sampler.scale(1)])
    assert scaled.advantages[0] == pytest.approx(tuple(5.0 * a for a in plain.advantages[0]))


def test_env_metrics_report_each_environment_on_its_own() -> None:
    rows = env_metrics(["a", "b"], [0, 1, 1], [[traj(1.0), traj(0.0)], [traj(0.4)], [traj(0.6)]], 0.5)
    assert rows["env/a/groups"] == 1.0 and rows["env/b/groups"] == 2.0
    assert rows["env/a/reward_mean"] == 0.5 and rows["env/b/reward_mean"] == pytest.approx(0.5)
    assert rows["env/a/success_rate"] == 0.5 and rows["env/b/success_rate"] == 0.5


@pytest.mark.slow
async def test_a_mixture_run_logs_reports_and_reverifies_each_environment_on_its_own(tmp_path: Path) -> None:
    """Two environments, one tiny policy: groups from both, per-environment rows, report and reverify."""
    import json
    import sys

    from toolgym.agents.eval.reverify import reverify_run
    from toolgym.training.experiments.report import write_report
    from toolgym.training.tiny_policy import TinyPolicy
    from toolgym.training.trainer import Trainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # toy_env registers its id on import
    letters = 'id = "toy_env:toolgym-test/Letters-v0"\nstages = [["answer"], ["answer", "lookup"]]'
    mixture = f'[[env]]\n{letters}\nname = "six"\n\n[[env]]\n{letters}\nname = "three"\nkwargs = {{ n_tasks = 3 }}\n'
    config = load_config(
        write(tmp_path, mixture),
        [
            "policy.kind=tiny",
            "policy.hidden=16",
            "policy.layers=1",
            "sampling.max_tokens=8",
            "train.steps=4",
            "train.tasks_per_step=3",
            "train.group_size=2",
            "train.rollouts.max_off_policy_steps=0",
            "train.seed=2",
        ],
    )
    run = tmp_path / "run"
    policy = TinyPolicy(hidden=16, layers=1, seed=2)
    trainer = Trainer(config, run, policy=policy)
    try:
        history = await trainer.run()
    finally:
        trainer.close()
    groups = {name: sum(m[f"env/{name}/groups"] for m in history) for name in ("six", "three")}
    assert groups["six"] > 0 and groups["three"] > 0 and sum(groups.values()) == 4 * 3
    assert all(m["mixture/six/weight"] + m["mixture/three/weight"] == pytest.approx(1.0) for m in history)
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    three = [r for r in records if r["env"] == "three"]
    assert three and {r["trajectory"]["task_id"] for r in three} <= set(trainer.env_task_ids[1])
    assert len(trainer.env_task_ids[1]) == 3 and len(trainer.env_task_ids[0]) == 6
    manifest = json.loads((run / "manifest.json").read_text())
    assert set(manifest["env"]["envs"]) == {"six", "three"} and manifest["env"]["weights"] == {
        "six": 1.0,
        "three": 1.0,
    }
    page = write_report(run).read_text()
    assert 'data-key="env/three/reward_mean"' in page and 'data-key="mixture/six/weight"' in page
    report = reverify_run(run, allow_import=True)  # the toy environment is imported by module name
    assert [s.name.rsplit(" ", 1)[-1] for s in report.sources] == ["[six]", "[three]"]
    assert [s.episodes for s in report.sources] == [2 * groups["six"], 2 * groups["three"]]
    assert report.errors == 0 and report.changed == 0


def test_the_heldout_env_is_the_first_unless_named(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO), ["heldout.n=10"])
    assert config.heldout_index == 0 and config.heldout_env is config.envs[0]
    named = load_config(write(tmp_path, TWO), ["heldout.n=10", "heldout.env=code"])
    assert named.heldout_index == 1 and named.heldout_env.id == "toolgym/CodeExec-v0"


def _letters_and_target(tmp_path: Path, target_split: str) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # toy_env registers its ids on import
    return write(
        tmp_path,
        '[[env]]\nid = "toy_env:toolgym-test/Letters-v0"\nname = "letters"\n\n'
        f'[[env]]\nid = "toy_env:toolgym-test/Target-v0"\nname = "target"\nkwargs = {{ split = "{target_split}" }}\n',
    )


MIXED_CURVE = [
    "policy.kind=tiny",
    "policy.hidden=16",
    "policy.layers=1",
    "sampling.max_tokens=6",
    "train.steps=2",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "train.rollouts.max_off_policy_steps=0",
    "train.seed=3",
    "heldout.env=target",
    "heldout.every=2",
    "heldout.curve_n=3",
    'heldout.curve_harnesses=["bare"]',
    "heldout.max_tokens=6",
]


@pytest.mark.slow
async def test_a_mixture_draws_its_heldout_curve_from_the_named_environment(tmp_path: Path) -> None:
    import json

    from toolgym.training.tiny_policy import TinyPolicy
    from toolgym.training.trainer import Trainer

    config = load_config(_letters_and_target(tmp_path, "train"), MIXED_CURVE)
    run = tmp_path / "run"
    trainer = Trainer(config, run, policy=TinyPolicy(hidden=16, layers=1, seed=3))
    try:
        await trainer.run()
    finally:
        trainer.close()
    assert trainer.heldout_train_ids == [f"train-{i}" for i in range(4)]  # the target's own ids
    curve = [json.loads(line) for line in (run / "heldout_curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0.0, 2.0]
    episodes = [
        json.loads(line)
        for line in (run / "heldout_curve" / "step-000002" / "trajectories-bare.jsonl")
        .read_text()
        .splitlines()
    ]
    assert len(episodes) == 3 and all(e["task_id"].startswith("test-") for e in episodes)
    assert {e["env_id"] for e in episodes} == {"toy_env:toolgym-test/Target-v0"}


@pytest.mark.slow
async def test_a_mixture_that_trains_on_the_heldout_split_is_refused(tmp_path: Path) -> None:
    """The named environment's own training ids are checked: a mixture's ``name:id`` ids never match."""
    from toolgym.training.tiny_policy import TinyPolicy
    from toolgym.training.trainer import Trainer

    config = load_config(_letters_and_target(tmp_path, "test"), MIXED_CURVE)
    trainer = Trainer(config, tmp_path / "run", policy=TinyPolicy(hidden=16, layers=1, seed=3))
    try:
        with pytest.raises(ConfigError, match=r"the held-out tasks include 3 training task\(s\)"):
            await trainer.run()
    finally:
        trainer.close()


def test_replace_keeps_working_on_one_environment_and_refuses_to_split_a_mixture(tmp_path: Path) -> None:
    import dataclasses

    single = load_config(None, [])
    moved = dataclasses.replace(single, env=dataclasses.replace(single.env, id="toolgym/CodeExec-v0"))
    assert moved.env.id == "toolgym/CodeExec-v0" and moved.envs == (moved.env,)
    one_table = load_config(write(tmp_path, '[[env]]\nid = "toolgym/CodeExec-v0"\n'))
    assert not one_table.is_mixture and one_table.env.id == "toolgym/CodeExec-v0"
    mixed = load_config(write(tmp_path, TWO))
    with pytest.raises(ConfigError, match="change envs, not env"):
        dataclasses.replace(mixed, env=moved.env)
