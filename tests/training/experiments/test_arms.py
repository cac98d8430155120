"""Experiment arms: the arms file, its refusals at start, the paired statistics and tables, and tiny
sets end to end (train, resume, compare, report).

The tiny policy has no Hugging Face export, so its held-out evaluation cannot run; the end-to-end
tests replace ``run_heldout`` with one that evaluates a scripted policy per arm on the toy
environment through the real evaluation writer (``toolgym.agents.eval.evaluate``), and give the warm
start a step-0 export of the tiny model's weights so that ``warm_start.reuse`` runs for real.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from builders import tiny_overrides

from toolgym.agents.eval.evaluate import paired_bootstrap, pick_tasks
from toolgym.cli.main import main
from toolgym.errors import ConfigError
from toolgym.training.config.load import _parse_value
from toolgym.training.experiments.arms import load_arms, plan_arms, shipped_arms, toml_literal
from toolgym.training.experiments.arms_results import (
    ArmComparison,
    ArmsResults,
    bootstrap_test,
    holm,
    latex_table,
    markdown_table,
)
from toolgym.training.experiments.arms_run import arms_command
from toolgym.training.experiments.study import study_table

TINY = tiny_overrides(steps=2, tasks_per_step=1, group_size=2)
TOY = "toy_env:toolgym-test/Letters-v0"


def _arms(tmp_path: Path, text: str, name: str = "arms.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


TWO = """
    baseline = "a"
    [[arm]]
    name = "a"
    [[arm]]
    name = "b"
    set = { "train.optim.lr" = 0.05 }
"""
THREE = TWO + '    [[arm]]\n    name = "c"\n    set = { "train.optim.lr" = 0.002 }\n'


# ----------------------------------------------------------------------------- the file
def test_toml_literals_round_trip_through_overrides() -> None:
    for value in [0, -3, 2.5e-05, 1.0, True, "a b", 'q"uote\\', "é", [], [["answer", "search"]],
                  {"tool": "open", "after": {"turn": 2}}, [{"id": "x", "kwargs": {"k": 1}}], math.inf]:  # fmt: skip
        assert _parse_value(toml_literal(value)) == value


def test_settings_layer_base_shared_command_line_then_arm(tmp_path: Path) -> None:
    path = _arms(
        tmp_path,
        """
        description = "two learning rates"
        [set]
        train.optim.warmup_steps = 1
        train.steps = 3
        env.kwargs = { max_turns = 3 }
        [[arm]]
        name = "a"
        [[arm]]
        name = "b"
        [arm.set]
        train.optim.lr = 0.05
        """,
    )
    spec = load_arms(path)
    assert spec.baseline == "a" and spec.description == "two learning rates"  # the first arm by default
    plan = plan_arms(path, None, [*TINY, "env.kwargs.n_tasks=5", "train.steps=4"])
    a, b = plan.configs["a"], plan.configs["b"]
    # the base set the id and its kwargs; [set] merged max_turns in (a table merges key by key)
    assert a.env.kwargs == {"max_turns": 3, "n_tasks": 5} == b.env.kwargs
    assert a.train.steps == b.train.steps == 4  # the command line over [set]
    assert a.train.optim.warmup_steps == b.train.optim.warmup_steps == 1  # [set] over the base
    assert (a.train.optim.lr, b.train.optim.lr) == (
        0.01,
        0.05,
    )  # the arm's own setting over the command line's
    assert plan.overrides["b"][-1] == "train.optim.lr=0.05"


def test_no_shipped_config_or_arms_file_uses_a_key_of_an_earlier_release(recwarn) -> None:
    """Every shipped config and arms file is written on today's keys: loading one warns of nothing
    (a flat key such as ``train.lr`` would warn that it moved to ``train.optim.lr``)."""
    from toolgym.training.config.load import load_config, shipped_configs

    for name in shipped_configs():
        load_config(name, [])
    for name in shipped_arms():
        plan_arms(name, None, [], f"runs/{name}")
    moved = [str(w.message) for w in recwarn if issubclass(w.category, FutureWarning)]
    assert not moved, moved


def test_the_shipped_arms_files_plan_without_loading_a_model() -> None:
    assert set(shipped_arms()) == {
        "curriculum",
        "compaction",
        "mixtures",
        "compaction-gpu",
        "mixtures-gpu",
        "controls",
    }
    controls = plan_arms("controls", None, [], "runs/x")
    assert controls.names == ["rl", "random-retriever", "no-update", "no-search", "shuffled-rewards"]
    assert controls.warm_start_from == "rl" and controls.spec.baseline == "random-retriever"
    random_arm = controls.configs["random-retriever"]
    assert random_arm.env.kwargs["retriever"] == "random" and random_arm.warm_start.reuse == "runs/x/rl"
    # every arm's warm start samples, and its held-out set searches, with the real retriever
    assert all(c.warm_start.kwargs["retriever"] == "bm25" for c in controls.configs.values())
    assert all(c.heldout.kwargs["retriever"] == "bm25" for c in controls.configs.values())
    assert controls.configs["shuffled-rewards"].train.reward_control == "shuffled"
    assert controls.configs["no-search"].curriculum.stages == (("answer",),)
    # without warm_start.kwargs the random-retriever arm would need a warm start of its own: refused
    with pytest.raises(
        ConfigError, match=r"arm 'random-retriever' changes what decides the warm start .*retriever"
    ):
        plan_arms("controls", None, ["warm_start.kwargs={}"], "runs/x")
    curriculum = plan_arms("curriculum", None, [], "runs/c")
    assert curriculum.names == ["progressive", "all-tools", "in-episode"]
    assert curriculum.warm_start_from == "progressive"
    assert curriculum.configs["all-tools"].warm_start.reuse == "runs/c/progressive"
    assert curriculum.configs["in-episode"].curriculum.unlocks[0]["tool"] == "open"
    compaction = plan_arms("compaction", None, [], "runs/k")
    assert [c.env.harness for c in compaction.configs.values()] == [
        "scaffold",
        "scaffold+compact",
        "scaffold+summary",
    ]
    mixtures = plan_arms("mixtures", None, [], "runs/m")
    assert [len(c.envs) for c in mixtures.configs.values()] == [1, 2, 2]
    # every arm, mixture or not, is evaluated on SearchQA's test split (the first [[env]] table)
    assert {c.heldout_env.id for c in mixtures.configs.values()} == {"toolgym/SearchQA-v0"}
    assert all(c.heldout.n == 1000 for c in mixtures.configs.values())
    # ... and heldout.env must name an environment of every arm
    with pytest.raises(ConfigError, match=r"arm 'search': heldout.env = 'code' names no environment"):
        plan_arms("mixtures", None, ["heldout.env=code"], "runs/m")


def test_the_gpu_versions_of_the_ablations_plan_on_the_gpu_config() -> None:
    # curriculum: the same arms over --config gpu; compaction and mixtures: their own GPU-sized files
    plans = {
        "curriculum": plan_arms("curriculum", "gpu", [], "runs/cg"),
        "compaction-gpu": plan_arms("compaction-gpu", None, [], "runs/kg"),
        "mixtures-gpu": plan_arms("mixtures-gpu", None, [], "runs/mg"),
    }
    for name, plan in plans.items():
        for arm, c in plan.configs.items():
            where = f"{name}/{arm}"
            assert (c.policy.kind, c.policy.dtype, c.policy.learner_device) == ("vllm", "bfloat16", "cuda"), (
                where
            )
            assert c.train.rollouts.max_off_policy_steps == 1 and c.train.steps >= 100, where
    assert [c.curriculum.stages for c in plans["curriculum"].configs.values()] == [
        (("answer", "search"), ("answer", "search", "open")),
        (),
        (("answer", "search"),),
    ]
    compaction = plans["compaction-gpu"].configs
    assert [c.env.harness for c in compaction.values()] == [
        "scaffold",
        "scaffold+compact",
        "scaffold+summary",
    ]
    assert all(
        c.env.id == "toolgym/ArxivRefs-v0" and c.env.max_total_tokens == 4096 for c in compaction.values()
    )
    mixtures = plans["mixtures-gpu"].configs
    assert [[e.id for e in c.envs] for c in mixtures.values()] == [
        ["toolgym/SearchQA-v0"],
        ["toolgym/SearchQA-v0", "toolgym/CodeExec-v0"],
        ["toolgym/SearchQA-v0", "toolgym/CodeExec-v0"],
    ]
    assert {c.heldout_env.id for c in mixtures.values()} == {"toolgym/SearchQA-v0"}
    assert [c.mixture.normalize for c in mixtures.values()][1:] == ["none", "std"]


# ----------------------------------------------------------------------------- refusals at start
REFUSALS = {
    "empty": ("", "has no arms: add \\[\\[arm\\]\\] tables"),
    "no arm tables": ('description = "x"\nbaseline = "a"\n', "has no arms"),
    "one arm": ('[[arm]]\nname = "a"\n', "has one arm \\('a'\\).*at least two"),
    "name twice": ('[[arm]]\nname = "a"\n[[arm]]\nname = "a"\nset = { "train.optim.lr" = 0.05 }\n', "arm name 'a' is used twice"),
    "name unfit for a directory": ('[[arm]]\nname = "a"\n[[arm]]\nname = "../b"\n', "name must be letters"),
    "unknown override key": (
        '[[arm]]\nname = "a"\n[[arm]]\nname = "b"\nset = { "train.lrr" = 0.05 }\n',
        "arm 'b': unknown config key 'train.lrr'. Did you mean 'train.optim.lr'\\?",
    ),
    "unknown section": (
        '[[arm]]\nname = "a"\n[[arm]]\nname = "b"\n[arm.set]\ntrian.lr = 0.05\n',
        "arm 'b': unknown config key 'trian'. Did you mean 'train'\\?",
    ),
    "unknown file key": ('baseline = "a"\narms = 2\n' + TWO.replace('baseline = "a"', ""), "unknown key 'arms'. Did you mean 'arm'\\?"),
    "baseline not in the set": (TWO.replace('baseline = "a"', 'baseline = "bb"'), "baseline 'bb' is not an arm of the set \\(a, b\\). Did you mean 'b'\\?"),
    "held-out seed": (
        TWO.replace('"train.optim.lr" = 0.05', '"heldout.seed" = 1'),
        "arm 'b' changes what the arms must share with arm 'a': heldout.seed \\(0 in 'a', 1 here: the held-out set\\)",
    ),
    "held-out split": (TWO.replace('"train.optim.lr" = 0.05', '"heldout.split" = "train"'), "heldout.split .*the held-out set"),
    "held-out size": (TWO.replace('"train.optim.lr" = 0.05', '"heldout.n" = 5'), "heldout.n \\(3 in 'a', 5 here: the held-out set\\)"),
    "seeds": (TWO.replace('"train.optim.lr" = 0.05', '"train.seed" = 7'), "train.seed \\(0 in 'a', 7 here: the seeds\\)"),
    "training tasks": (TWO.replace('"train.optim.lr" = 0.05', '"env.kwargs.n_tasks" = 4'), "env.kwargs.n_tasks .*the training environment"),
    "starting policy": (TWO.replace('"train.optim.lr" = 0.05', '"policy.hidden" = 16'), "policy.hidden \\(32 in 'a', 16 here: the starting policy\\)"),
    "allow too much": ('allow = ["heldout"]\n' + TWO, "allow may list only 'env'"),
    "the same arm twice": (TWO.replace('"train.optim.lr" = 0.05', '"train.optim.lr" = 0.01'), "arms 'a' and 'b' resolve to the same settings"),
    "unknown environment": (
        TWO.replace('name = "a"', 'name = "a"\nset = { "env.id" = "toolgym/SerchQA-v0" }').replace('"train.optim.lr" = 0.05', '"train.optim.lr" = 0.05, "env.id" = "toolgym/SerchQA-v0"'),
        "arm 'a': unknown environment id 'toolgym/SerchQA-v0'. Did you mean 'toolgym/SearchQA-v0'\\?",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_arms_are_refused_at_start_before_any_model_loads(tmp_path: Path, monkeypatch, case: str) -> None:
    import toolgym.training.policy_build as policies
    import toolgym.training.trainer as trainer  # imported first: it holds build_policy by name

    def no_model(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a policy was built before the arms were checked")

    monkeypatch.setattr(policies, "build_policy", no_model)
    monkeypatch.setattr(trainer, "build_policy", no_model)
    text, message = REFUSALS[case]
    path = _arms(tmp_path, text)
    out = tmp_path / "set"
    with pytest.raises(ConfigError, match=message):
        arms_command(path, None, [*TINY, "heldout.n=3"], out, say=lambda _: None)
    assert not out.exists() or not any(out.iterdir()), "nothing is trained or written"


def test_the_command_line_reports_a_bad_arms_file_as_an_error(tmp_path: Path, capsys) -> None:
    path = _arms(tmp_path, TWO.replace('baseline = "a"', 'baseline = "c"'))
    assert main(["train", "--arms", str(path), "--out", str(tmp_path / "set"), *TINY]) == 2
    assert "baseline 'c' is not an arm of the set" in capsys.readouterr().err


def test_arms_may_train_on_other_environments_only_when_allowed(tmp_path: Path) -> None:
    other = TWO.replace('"train.optim.lr" = 0.05', '"env.kwargs.n_tasks" = 4')
    with pytest.raises(ConfigError, match='allow = \\["env"\\] lets arms differ there'):
        plan_arms(_arms(tmp_path, other), None, TINY)
    plan = plan_arms(_arms(tmp_path, 'allow = ["env"]\n' + other, "allowed.toml"), None, TINY)
    assert plan.configs["b"].env.kwargs == {"n_tasks": 4}
    # the held-out tasks come from the first environment: allow never frees them
    held = TWO.replace('"train.optim.lr" = 0.05', '"heldout.kwargs" = { n_tasks = 4 }')
    with pytest.raises(ConfigError, match="heldout.kwargs.n_tasks .*the held-out set"):
        plan_arms(_arms(tmp_path, 'allow = ["env"]\n' + held, "held.toml"), None, [*TINY, "heldout.n=3"])


def test_an_arm_that_changes_the_shared_warm_start_is_refused(tmp_path: Path) -> None:
    path = _arms(tmp_path, TWO.replace('"train.optim.lr" = 0.05', '"env.harness" = "scaffold"'))
    with pytest.raises(ConfigError, match="arm 'b' changes what decides the warm start .* env.harness"):
        plan_arms(path, None, [*TINY, "warm_start.samples=2"])
    plan = plan_arms(path, None, TINY)  # without a warm start the harness is the arm's to change
    assert plan.warm_start_from is None and plan.configs["b"].env.harness == "scaffold"


# ----------------------------------------------------------------------------- statistics and tables
def test_holm_adjusts_hand_made_p_values_exactly() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.2]) == pytest.approx([0.5, 0.4])  # monotone: 2 x 0.2 then max(0.4, 0.5)
    assert holm([0.3, 0.3, 0.3]) == pytest.approx([0.9, 0.9, 0.9])
    assert holm([0.6, 0.01]) == pytest.approx([0.6, 0.02])
    assert holm([0.02]) == [0.02]  # one comparison: nothing to correct
    assert holm([0.4, 0.5, 0.9]) == pytest.approx([1.0, 1.0, 1.0])  # capped at 1


def test_the_bootstrap_test_matches_compare_and_widens_with_the_family() -> None:
    rng = np.random.default_rng(3)
    a = list(rng.random(40))
    b = [x + d for x, d in zip(a, rng.normal(0.1, 0.3, 40), strict=True)]
    mean, ci95, ci, p = bootstrap_test(a, b, family=1, seed=5)
    assert (mean, *ci95) == pytest.approx(paired_bootstrap(a, b, seed=5), abs=1e-12)
    assert ci == pytest.approx(ci95)  # a family of one is not widened
    _, ci95_6, ci6, p6 = bootstrap_test(a, b, family=6, seed=5)
    assert ci95_6 == ci95 and p6 == p
    assert ci6[0] < ci95[0] and ci6[1] > ci95[1]
    # the p-value is the doubled share of resampled means on the far side of zero (+1 corrected)
    diff = np.asarray(b) - np.asarray(a)
    means = diff[np.random.default_rng(5).integers(0, 40, size=(10_000, 40))].mean(axis=1)
    assert p == pytest.approx(2 * (min((means <= 0).sum(), (means >= 0).sum()) + 1) / 10_001)


def test_the_bootstrap_test_on_degenerate_differences() -> None:
    assert bootstrap_test([0.5] * 4, [0.5] * 4) == (0.0, (0.0, 0.0), (0.0, 0.0), 1.0)
    mean, _, ci, p = bootstrap_test([0.5] * 4, [1.0] * 4, family=3)
    assert mean == 0.5 and ci == (0.5, 0.5) and p == pytest.approx(2 / 10_001)
    with pytest.raises(ValueError):
        bootstrap_test([], [])


def _hand_made() -> ArmsResults:
    def c(arm: str, track: str, diff: float, lo: float, hi: float, p: float) -> ArmComparison:
        return ArmComparison(
            arm, track, 10, 0.1, 0.1 + diff, diff, (lo, hi), (lo - 0.01, hi + 0.01), p / 2, p
        )

    return ArmsResults(
        baseline="base_line",
        arms=("base_line", "more"),
        tracks=("bare", "pooled"),
        rewards={"base_line": {"bare": 0.1, "pooled": 0.125}, "more": {"bare": 0.15, "pooled": 0.1}},
        comparisons=(
            c("more", "bare", 0.05, 0.01, 0.09, 0.04),
            c("more", "pooled", -0.025, -0.06, 0.01, 0.0004),
        ),
        heldout={"env_id": "toolgym/SearchQA-v0", "split": "test", "n": 10, "seed": 0, "metric": "f1"},
        description="Learning rates",
    )


def test_the_markdown_table_text() -> None:
    text = markdown_table(_hand_made())
    assert text.splitlines()[:4] == [
        "| arm | bare | Δ bare [CI] | p (Holm) | pooled | Δ pooled [CI] | p (Holm) |",
        "|---|---|---|---|---|---|---|",
        "| base_line (baseline) | 0.100 | — | — | 0.125 | — | — |",
        "| more | 0.150 | +0.050 [+0.000, +0.100] | 0.040 | 0.100 | -0.025 [-0.070, +0.020] | <0.001 |",
    ]
    assert text.splitlines()[5] == (
        "Learning rates. Held-out reward (toolgym/SearchQA-v0 split test, 10 tasks, seed 0, greedy; reward: f1) "
        "per arm and track; Δ = arm − base_line on the same tasks and seeds, paired; pooled = each task's mean "
        "over tracks. Intervals: paired bootstrap (10000 resamples), Bonferroni-widened to simultaneous 95% "
        "over the m = 2 comparisons; p: two-sided paired-bootstrap p-values, Holm–Bonferroni-adjusted over m."
    )


def test_the_latex_table_text() -> None:
    text = latex_table(_hand_made(), label="arms-lr")
    lines = text.splitlines()
    assert lines[:8] == [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        r"\begin{tabular}{lrrrrrr}",
        r"\toprule",
        r" & \multicolumn{3}{c}{bare} & \multicolumn{3}{c}{pooled} \\",
        r"\cmidrule(lr){2-4} \cmidrule(lr){5-7}",
        r"arm & reward & $\Delta$ [CI] & $p$ & reward & $\Delta$ [CI] & $p$ \\",
    ]
    assert lines[9] == r"base\_line (baseline) & 0.100 & -- & -- & 0.125 & -- & -- \\"
    assert lines[10] == (
        r"more & 0.150 & $+0.050$ [$+0.000$, $+0.100$] & 0.040 & 0.100 & $-0.025$ [$-0.070$, $+0.020$] & $<$0.001 \\"
    )
    assert r"$\Delta$ = arm $-$ base\_line" in text and "Holm--Bonferroni" in text
    assert lines[-2:] == [r"\label{tab:arms-lr}", r"\end{table}"]


# ----------------------------------------------------------------------------- tiny sets end to end
#: each arm's scripted held-out answers: the reward is the share of letters in the answer
ANSWERS = {
    "base": lambda n: "1234",
    "slow": lambda n: "ab12",
    "fast": lambda n: "abc1" if n % 2 == 0 else "ab12",
}


def _in_this_process(monkeypatch) -> None:
    """Arms in the test's own process, where the functions replaced below are seen."""
    import toolgym.training.experiments.arms_run as arms_run

    monkeypatch.setattr(arms_run, "ARM_PROCESS", False)


def _fake_heldout(monkeypatch, calls: list[str] | None = None) -> None:
    """``run_heldout`` for the tiny policy: the base model and each arm's 'export' are scripted."""
    import toolgym.training.commands as commands
    import toolgym.training.heldout.run as heldout_run

    _in_this_process(monkeypatch)

    async def run_heldout(config, run_dir, train_task_ids, *, warm_started=False, served=None, progress=None):
        from toolgym.agents.eval.evaluate import evaluate
        from toolgym.agents.eval.runs import compare_runs, load_eval_run
        from toolgym.agents.policies.base import RulePolicy

        run_dir = Path(run_dir)
        if calls is not None:
            calls.append(run_dir.name)
        hc = config.heldout
        for label, key in (("base", "base"), ("trained", run_dir.name)):

            def rule(transcript: str, key: str = key) -> str:
                n = int(re.findall(r"Say a word with (\d+) letters", transcript)[-1])
                return f'<tool_call>{{"name": "answer", "arguments": {{"answer": "{ANSWERS[key](n)}"}}}}</tool_call>'

            await evaluate(
                config.env.id,
                lambda rule=rule, label=label: RulePolicy(rule, name=label),
                hc.harnesses,
                n=hc.n,
                seed=hc.seed,
                concurrency=2,
                out_dir=run_dir / "heldout" / label,
                policy_label=label,
            )
        cmp = compare_runs(
            load_eval_run(run_dir / "heldout" / "base"), load_eval_run(run_dir / "heldout" / "trained")
        )
        rows = [
            {"harness": t.harness, "n": t.n, "base": t.reward_a, "trained": t.reward_b, "diff": t.diff,
             "ci": [t.low, t.high], "base_em": 0.0, "trained_em": 0.0}
            for t in cmp.tracks
        ]  # fmt: skip
        return {"env_id": config.env.id, "split": hc.split, "n": hc.n, "seed": hc.seed, "tracks": rows}

    monkeypatch.setattr(heldout_run, "run_heldout", run_heldout)
    monkeypatch.setattr(commands, "run_heldout", run_heldout)  # imported there by name


def _export_step_zero(monkeypatch) -> None:
    """The tiny model writes no export; give its warm start one, so ``warm_start.reuse`` loads it."""
    import toolgym.training.export as export
    import toolgym.training.trainer as trainer

    def export_checkpoint(run_dir, model, policy, *, step, keep=2):
        from safetensors.torch import save_file

        if step == 0:
            folder = Path(run_dir) / "export" / "step-000000"
            folder.mkdir(parents=True, exist_ok=True)
            weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            save_file(weights, str(folder / "model.safetensors"))
        return None

    for module in (export, trainer):  # the trainer imports it by name
        monkeypatch.setattr(module, "export_checkpoint", export_checkpoint)


SET = """
    description = "Tiny learning rates"
    baseline = "slow"
    [[arm]]
    name = "slow"
    [[arm]]
    name = "fast"
    set = { "train.optim.lr" = 0.05 }
    [[arm]]
    name = "base"
    description = "no update at all"
    set = { "train.optim.lr" = 0.0 }
"""
HELDOUT = ["heldout.n=4", 'heldout.harnesses=["bare", "scaffold"]']
WARM = ["warm_start.samples=2", "warm_start.epochs=1", "warm_start.min_reward=0.3"]


def test_a_tiny_set_trains_every_arm_and_pairs_them_with_the_baseline(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    _fake_heldout(monkeypatch)
    _export_step_zero(monkeypatch)
    path = _arms(tmp_path, SET)
    out = tmp_path / "set"
    assert main(["train", "--arms", str(path), "--out", str(out), *TINY, *HELDOUT, *WARM]) == 0
    printed = capsys.readouterr().out
    for arm in ("slow", "fast", "base"):  # ordinary run directories
        rows = [json.loads(line) for line in (out / arm / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1.0, 2.0]
        assert (out / arm / "checkpoint.pt").is_file() and (
            out / arm / "heldout" / "trained" / "eval.json"
        ).is_file()
        assert json.loads((out / arm / "arm.json").read_text())["status"] == "complete"
    # one warm start, made by the first arm, loaded by the others
    configs = {arm: json.loads((out / arm / "config.json").read_text()) for arm in ("slow", "fast", "base")}
    assert configs["slow"]["warm_start"]["reuse"] == ""
    assert (
        configs["fast"]["warm_start"]["reuse"] == configs["base"]["warm_start"]["reuse"] == str(out / "slow")
    )
    warm = {arm: json.loads((out / arm / "warm_start.json").read_text()) for arm in configs}
    assert warm["fast"] == warm["slow"] == warm["base"]
    assert "arm 1/3 'slow': training" in printed and "warm start: reused" in printed
    # the paired table: fast - slow is +0.25 on the even-length tasks, base - slow is -0.5 everywhere
    ids = pick_tasks([f"w{i}" for i in range(6)], 4, 0)
    expected = sum(0.25 for t in ids if (int(t[1:]) + 2) % 2 == 0) / 4
    results = json.loads((out / "arms.json").read_text())["results"]
    assert results["baseline"] == "slow" and results["tracks"] == ["bare", "scaffold", "pooled"]
    assert results["correction"]["family"] == 6 and results["correction"]["interval_level"] == pytest.approx(
        1 - 0.05 / 6
    )
    by = {(c["arm"], c["track"]): c for c in results["comparisons"]}
    for track in ("bare", "scaffold", "pooled"):
        assert by[("fast", track)]["diff"] == pytest.approx(expected)
        assert by[("base", track)]["diff"] == pytest.approx(-0.5) and by[("base", track)]["ci"] == [
            -0.5,
            -0.5,
        ]
        assert by[("base", track)]["p"] == pytest.approx(2 / 10_001)
        assert by[("base", track)]["p_holm"] == pytest.approx(6 * 2 / 10_001)  # the three smallest tie
        assert results["rewards"]["slow"][track] == pytest.approx(0.5)
    table = (out / "arms.md").read_text()
    assert table in printed
    assert "| base | 0.000 | -0.500 [-0.500, -0.500] | 0.001 |" in table
    assert r"\multicolumn{3}{c}{scaffold}" in (out / "arms.tex").read_text()
    # the arms' result files alone, on another machine, give the same table
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy(out / "study.json", kept / "study.json")
    for arm in ("slow", "fast", "base"):
        (kept / arm).mkdir()
        shutil.copy(out / arm / "result.json", kept / arm / "result.json")
        result = json.loads((kept / arm / "result.json").read_text())
        assert result["what"] == "run" and [s["step"] for s in result["steps"]] == [1.0, 2.0]
        assert result["config"]["train"]["steps"] == 2 and result["wall_s"] > 0
        assert set(result["evaluations"]) == {"base", "trained"} and result["versions"]["toolgym"]
        assert (kept / arm / "result.json").stat().st_size < 64_000, "kilobytes, never weights"
        assert str(tmp_path) not in (kept / arm / "result.json").read_text(), "no path of this machine"
    assert study_table(kept) == table
    assert main(["results", "table", str(kept)]) == 0 and table in capsys.readouterr().out
    (kept / "fast" / "result.json").unlink()
    with pytest.raises(ConfigError, match=r"the result of 1 of 3 rows is missing: fast \(fast/result.json\)"):
        study_table(kept)
    # toolgym report on the set: every arm's curve on one plot, the table, each arm's own report
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    reward_plot = page[page.index("Training reward") : page.index("</figure>", page.index("Training reward"))]
    assert [m for m in re.findall(r'data-key="([^"]+)"', reward_plot)] == ["slow", "fast", "base"]
    assert '<table id="arms">' in page and "-0.500 [-0.500, -0.500]" in page
    assert (out / "fast" / "report.html").is_file() and 'href="fast/report.html"' in page
    assert "<td>no update at all</td><td>train.optim.lr=0.0</td>" in page
    # the first arm's weights gone (its records kept): an arm trained again rebuilds the shared warm
    # start from the first arm's config.json and warm_start.json, and checks it by the recorded hash
    shutil.rmtree(out / "slow" / "export")
    shutil.rmtree(out / "fast")
    assert main(["train", "--arms", str(path), "--out", str(out), *TINY, *HELDOUT, *WARM]) == 0
    printed = capsys.readouterr().out
    assert "arm 1/3 'slow': finished earlier" in printed and "arm 2/3 'fast': training" in printed
    assert "keeps no weights; rebuilding its warm start here" in printed
    again = json.loads((out / "fast" / "warm_start.json").read_text())
    assert (
        len(warm["slow"]["weights_sha256"]) == 64
        and again["weights_sha256"] == warm["slow"]["weights_sha256"]
    )


class MachineWentAway(Exception):
    pass


def test_an_interrupted_set_resumes_where_it_stopped(tmp_path: Path, monkeypatch) -> None:
    import toolgym.training.trainer as trainer_module

    calls: list[str] = []
    _fake_heldout(monkeypatch, calls)
    real = trainer_module.write_step

    def write_step(run_dir, step, *args, **kwargs):  # arm 'fast' is killed during its second step
        if Path(run_dir).name == "fast" and step == 2:
            raise MachineWentAway
        return real(run_dir, step, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "write_step", write_step)
    path = _arms(tmp_path, SET)
    out = tmp_path / "set"
    with pytest.raises(MachineWentAway):
        arms_command(path, None, [*TINY, *HELDOUT], out, say=lambda _: None)
    assert json.loads((out / "fast" / "arm.json").read_text()) == {
        "name": "fast",
        "status": "running",
        "attempts": 1,
    }
    assert (out / "fast" / "checkpoint.pt").is_file() and not (out / "base").exists()
    slow_metrics = (out / "slow" / "metrics.jsonl").read_bytes()
    stamp = (out / "slow" / "metrics.jsonl").stat().st_mtime_ns

    monkeypatch.setattr(trainer_module, "write_step", real)
    lines: list[str] = []
    arms_command(path, None, [*TINY, *HELDOUT], out, say=lines.append)
    assert calls == ["slow", "fast", "base"]  # slow is neither trained nor evaluated again
    assert any("arm 1/3 'slow': finished earlier" in line for line in lines)
    assert any("arm 2/3 'fast': resuming" in line for line in lines)
    assert (out / "slow" / "metrics.jsonl").read_bytes() == slow_metrics
    assert (out / "slow" / "metrics.jsonl").stat().st_mtime_ns == stamp
    fast = [json.loads(line)["step"] for line in (out / "fast" / "metrics.jsonl").read_text().splitlines()]
    assert fast == [1.0, 2.0]  # step 2 trained after the resume from step 1's checkpoint, once
    record = json.loads((out / "fast" / "arm.json").read_text())
    assert record["status"] == "complete" and record["attempts"] == 2 and record["resumed"]
    assert (out / "arms.md").is_file()

    # the same command once more: every arm is skipped; another setting for a started arm is refused
    arms_command(path, None, [*TINY, *HELDOUT], out, say=lines.append)
    assert calls == ["slow", "fast", "base"]
    with pytest.raises(ConfigError, match="arm 'slow' in .* was started with other settings: train.optim.lr"):
        arms_command(path, None, [*TINY, *HELDOUT, "train.optim.lr=0.02"], out, say=lambda _: None)


def test_an_arm_trained_against_another_environment_state_is_refused(tmp_path: Path, monkeypatch) -> None:
    import toolgym.training.trainer as trainer_module

    _in_this_process(monkeypatch)
    path = _arms(tmp_path, TWO)
    out = tmp_path / "set"
    overrides = tiny_overrides(steps=1, tasks_per_step=1, group_size=2)
    real = trainer_module.write_train_manifest

    def tampered(run_dir, *args, **kwargs):  # the first arm's data hash as if the data had changed since
        written = real(run_dir, *args, **kwargs)
        if Path(run_dir).name == "a":
            manifest = json.loads(written.read_text())
            manifest["env"]["data_sha256"] = "0" * 64
            written.write_text(json.dumps(manifest))
        return written

    monkeypatch.setattr(trainer_module, "write_train_manifest", tampered)
    with pytest.raises(
        ConfigError, match="arm 'b' trained against another environment state than arm 'a': env.data_sha256"
    ):
        arms_command(path, None, overrides, out, say=lambda _: None)
    assert json.loads((out / "b" / "arm.json").read_text())["status"] == "running"


@pytest.mark.slow
def test_a_set_without_a_held_out_evaluation_gives_curves_only(tmp_path: Path, capfd) -> None:
    """Each arm in a process of its own (the default): its output passes through."""
    out = tmp_path / "set"
    path = _arms(tmp_path, TWO)
    assert (
        main(
            [
                "train",
                "--arms",
                str(path),
                "--out",
                str(out),
                *tiny_overrides(steps=1, tasks_per_step=1, group_size=2),
            ]
        )
        == 0
    )
    printed = capfd.readouterr().out
    assert "learning curves only" in printed
    assert printed.count("training: 1/1") == 2  # each arm's own progress, from its process
    data = json.loads((out / "arms.json").read_text())
    assert "results" not in data and [a["status"] for a in data["arms"]] == ["complete", "complete"]
    assert not (out / "arms.md").exists()
    assert main(["report", str(out)]) == 0
    assert "No paired table" in (out / "report.html").read_text()


@pytest.mark.slow
def test_arms_side_by_side_on_ray_train_what_one_after_another_trains(tmp_path: Path, capsys) -> None:
    path = _arms(tmp_path, THREE)
    tiny = tiny_overrides(steps=2, tasks_per_step=1, group_size=2)
    one, ray = tmp_path / "one", tmp_path / "ray"
    assert main(["train", "--arms", str(path), "--out", str(one), *tiny]) == 0
    assert main(["train", "--arms", str(path), "--out", str(ray), "--arm-workers", "3", *tiny]) == 0
    printed = capsys.readouterr().out
    assert "arm 'c': started on Ray" in printed and "arm 3/3 'c': done in" in printed

    def rows(run: Path) -> list[dict[str, float]]:
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]

    for arm in ("a", "b", "c"):
        # same seeds, groups and rewards; the losses agree to float rounding (Ray runs a one-CPU task
        # on one thread, so sums are added in another order)
        assert rows(ray / arm) == [pytest.approx(r, rel=1e-5, abs=1e-6) for r in rows(one / arm)]
        assert json.loads((ray / arm / "arm.json").read_text())["status"] == "complete"
        assert "training: 2/2" in (ray / arm / "train.log").read_text()  # the arm's own output
    assert rows(ray / "b")[1]["loss/grad_norm"] != pytest.approx(rows(ray / "a")[1]["loss/grad_norm"])
    # the same command again skips every finished arm
    assert main(["train", "--arms", str(path), "--out", str(ray), "--arm-workers", "3", *tiny]) == 0
    assert capsys.readouterr().out.count("finished earlier") == 3


def test_an_arm_process_that_fails_stops_the_set_with_its_name(tmp_path: Path, capfd) -> None:
    from toolgym.errors import RunStopped
    from toolgym.training.experiments.arms_run import train_arm_process

    with pytest.raises(RunStopped, match="arm 'b' exited with status 2 .*rerun the same command"):
        train_arm_process(str(tmp_path / "missing.toml"), TINY, tmp_path / "b", "b")
    assert "toolgym: error:" in capfd.readouterr().err  # the arm's own message, passed through


@pytest.mark.slow
def test_an_arm_killed_outright_has_its_policys_processes_stopped(tmp_path: Path, monkeypatch) -> None:
    import signal
    import subprocess
    import sys
    import threading
    import time

    from toolgym.errors import RunStopped
    from toolgym.procs import describe, process_record
    from toolgym.training.experiments.arms_run import train_arm_process

    here = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")])))
    arm, failure = tmp_path / "a", []

    def run() -> None:
        try:
            train_arm_process(None, tiny_overrides(steps=10_000, tasks_per_step=1, group_size=2), arm, "a")
        except RunStopped as exc:
            failure.append(str(exc))

    thread = threading.Thread(target=run)
    thread.start()
    record, deadline = process_record(arm), time.monotonic() + 120
    while not (arm / "metrics.jsonl").exists():  # the arm's trainer listed its policy's processes by now
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.2)
    listed = json.loads(record.read_text())
    # a stand-in for the vLLM engine a killed arm leaves behind (the tiny policy starts none)
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        listed["processes"] = [describe(engine.pid)]
        record.write_text(json.dumps(listed))
        os.kill(listed["owner"]["pid"], signal.SIGKILL)  # as the out-of-memory killer does
        thread.join(timeout=60)
        assert failure and "arm 'a' was killed by SIGKILL; the 1 process(es) its policy" in failure[0]
        assert engine.wait(timeout=5) == -signal.SIGKILL
    finally:
        engine.kill()


@pytest.mark.slow
def test_an_interrupted_arm_process_is_stopped_not_left_running() -> None:
    import signal
    import subprocess
    import sys

    from toolgym.training.experiments.arms_run import _stop

    # a child that did not get the Ctrl-C (e.g. this process was killed): SIGTERM after the grace
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    _stop(child)
    assert child.returncode == -signal.SIGTERM


def _processes_writing_to(path: Path) -> list[int]:
    """Pids whose command line names ``path`` (an arm's ``--out``)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and str(path) in cmdline:
            found.append(int(proc.name))
    return found


@pytest.mark.slow
def test_killing_the_set_stops_its_running_arm(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "set"
    here = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))
    )
    long = tiny_overrides(steps=10_000, tasks_per_step=1, group_size=2)
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolgym",
            "train",
            "--arms",
            str(_arms(tmp_path, TWO)),
            "--out",
            str(out),
            *long,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (out / "a" / "metrics.jsonl").exists():  # arm a is training in its own process
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    assert _processes_writing_to(out / "a")
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=150) == 128 + signal.SIGTERM
    assert _processes_writing_to(out / "a") == []  # the arm was stopped, not orphaned
    assert json.loads((out / "a" / "arm.json").read_text())["status"] == "running"  # resumable


def test_arm_workers_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--arm-workers must be >= 1 \(1: one arm after another\), got 0"):
        arms_command(_arms(tmp_path, TWO), None, TINY, tmp_path / "set", workers=0, say=lambda _: None)


class _FakeRay:
    """Ray's task calls, run in order: records what was running when each arm was submitted."""

    class exceptions:  # noqa: N801 (mirrors ray.exceptions)
        class RayTaskError(Exception):
            cause = None

    def __init__(self, failing: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.running: list[str] = []
        self.log: list[tuple[str, tuple[str, ...]]] = []
        self.failing = failing
        self.decorated: dict[str, Any] = {}

    def remote(self, fn: Any = None, **options: Any) -> Any:
        if fn is None:  # ray.remote(max_calls=1)(fn)
            self.decorated.update(options)
            return self.remote
        fake = self

        class Task:
            def options(self, **kwargs: Any) -> Any:
                return self

            def remote(self, config: Any, overrides: Any, arm_dir: str, sys_path: Any) -> str:
                name = Path(arm_dir).name
                fake.log.append((name, tuple(fake.running)))
                fake.running.append(name)
                return name

        return Task()

    def wait(self, refs: list[str], num_returns: int) -> tuple[list[str], list[str]]:
        return [refs[0]], refs[1:]

    def get(self, ref: str) -> float:
        self.running.remove(ref)
        if ref in self.failing:
            raise RuntimeError(f"arm {ref} broke")
        return 1.0


def _run_on(
    fake: _FakeRay, plan: Any, out: Path, monkeypatch, *, workers: int, done: list[str] | None = None
) -> list[str]:
    """``run_arms_on_ray`` on the stand-in; returns the arms finished, in order."""
    import toolgym.training.experiments.arms_ray as arms_ray

    monkeypatch.setattr(arms_ray, "acquire_ray", lambda n: fake)
    monkeypatch.setattr(arms_ray, "release_ray", lambda: None)
    done = [] if done is None else done
    arms_ray.run_arms_on_ray(
        plan,
        out,
        ["a", "b", "c"],
        workers,
        begin=lambda n: None,
        finish=lambda n, s: done.append(n),
        say=print,
    )
    return done


@pytest.mark.parametrize("loads_first", [True, False])
def test_on_ray_the_first_arm_runs_alone_when_the_others_load_from_it(
    tmp_path: Path, monkeypatch, loads_first: bool
) -> None:
    fake = _FakeRay()
    extra = ["warm_start.samples=2"] if loads_first else []
    plan = plan_arms(_arms(tmp_path, THREE), None, [*TINY, *extra])
    assert (plan.warm_start_from == "a") is loads_first
    done = _run_on(fake, plan, tmp_path, monkeypatch, workers=3)
    if loads_first:  # b and c wait for a; then both start together
        assert fake.log == [("a", ()), ("b", ()), ("c", ("b",))]
    else:
        assert fake.log == [("a", ()), ("b", ("a",)), ("c", ("a", "b"))]
    assert done == ["a", "b", "c"]
    assert fake.decorated == {"max_calls": 1}  # a fresh worker process per arm


def test_on_ray_a_failed_arm_is_named_and_the_others_finish(tmp_path: Path, monkeypatch) -> None:
    from toolgym.errors import RunStopped

    plan = plan_arms(_arms(tmp_path, THREE), None, TINY)
    done: list[str] = []
    with pytest.raises(
        RunStopped, match=r"arms failed: 'b' \(RuntimeError: arm b broke; log .*b/train.log\)"
    ):
        _run_on(_FakeRay(failing={"b"}), plan, tmp_path, monkeypatch, workers=2, done=done)
    assert done == ["a", "c"]


def test_a_set_resumes_after_toolgym_gained_a_setting_left_at_its_default(tmp_path: Path) -> None:
    from toolgym.training.config import to_dict
    from toolgym.training.experiments.arms import PLAN

    path, out = _arms(tmp_path, TWO), tmp_path / "set"
    plan = plan_arms(path, None, TINY, out)
    stored = {name: to_dict(config) for name, config in plan.configs.items()}
    del stored["a"]["heldout"]["env"]  # a plan written before heldout.env existed
    (out / "a").mkdir(parents=True)
    (out / PLAN).write_text(json.dumps({"arms": [{"name": n, "config": c} for n, c in stored.items()]}))
    plan_arms(path, None, TINY, out)  # the new setting sits at its default: nothing changed
    with pytest.raises(ConfigError, match=r"arm 'a' in .* was started with other settings: heldout.env"):
        plan_arms(path, None, [*TINY, "heldout.env=Letters-v0"], out)  # not at its default: refused


@pytest.mark.slow
def test_the_controls_set_trains_every_arm_from_one_warm_start(tmp_path: Path, monkeypatch, capsys) -> None:
    """A two-step smoke of the shipped controls set on the tiny policy (SearchQA's hard questions, no
    held-out evaluation): one warm start made on the real retriever and loaded by every arm, the
    random retriever, shuffled rewards and no search each where its arm says."""
    _in_this_process(monkeypatch)
    _export_step_zero(monkeypatch)
    out = tmp_path / "controls"
    tiny = ["policy.kind=tiny", "policy.hidden=32", "sampling.max_tokens=200", "env.max_total_tokens=8192"]
    small = ["train.steps=2", "train.tasks_per_step=1", "train.group_size=2", "train.dynamic_sampling=false"]
    rest = ["train.rollouts.max_off_policy_steps=0", "train.rollouts.workers=2", "warm_start.tasks=2"]
    assert (
        main(
            [
                "train",
                "--arms",
                "controls",
                "--out",
                str(out),
                *tiny,
                *small,
                *rest,
                "heldout.n=0",
                "heldout.every=0",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    arms = ["rl", "random-retriever", "no-update", "no-search", "shuffled-rewards"]
    assert all(json.loads((out / a / "arm.json").read_text())["status"] == "complete" for a in arms)
    warm = [json.loads((out / a / "warm_start.json").read_text()) for a in arms]
    assert warm[0]["kept"] > 0 and all(w["weights_sha256"] == warm[0]["weights_sha256"] for w in warm)
    assert printed.count("warm start: reused") == 4
    manifests = {a: json.loads((out / a / "manifest.json").read_text()) for a in arms}
    assert manifests["random-retriever"]["env"]["provenance"]["index"]["retriever"] == "random"
    assert "retriever" not in manifests["rl"]["env"]["provenance"]["index"]  # BM25's own provenance
    config = {a: json.loads((out / a / "config.json").read_text()) for a in arms}
    assert config["shuffled-rewards"]["train"]["reward_control"] == "shuffled"
    steps = {a: [json.loads(x) for x in (out / a / "metrics.jsonl").read_text().splitlines()] for a in arms}
    assert all(len(rows) == 2 and "use/searched" in rows[0] for rows in steps.values())
    assert "tool/search/calls" not in steps["no-search"][0] and "tool/search/calls" in steps["rl"][0]
