"""The tool curriculum, driven with synthetic results."""

from __future__ import annotations

import json

import pytest

from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.training.config import CurriculumConfig
from toolgym.training.sampling.curriculum import ToolCurriculum

STAGES = (("answer",), ("answer", "search"), ("answer", "search", "open"))


def traj(task_id: str, reward: float, status: str = "ok") -> Trajectory:
    return Trajectory(
        env_id="e",
        task_id=task_id,
        seed=0,
        harness="bare",
        allowed_tools=(),
        messages=(),
        token_ids=(),
        loss_mask=(),
        logprobs=(),
        reward=reward,
        metrics={},
        status=status,
    )


def batch(successes: int, total: int = 4, tasks: int = 4) -> list[Trajectory]:
    return [traj(f"t{i % tasks}", 1.0 if i < successes else 0.0) for i in range(total)]


def test_disabled_curriculum_restricts_nothing() -> None:
    cur = ToolCurriculum(CurriculumConfig())
    assert cur.tools_for("t0") is None
    assert cur.observe(batch(0)) is False


def test_unsolved_share_unlocks_after_patience_and_min_stay() -> None:
    cfg = CurriculumConfig(
        stages=STAGES, window=10, min_attempts=1, unsolved_threshold=0.8, patience=2, min_stay=3
    )
    cur = ToolCurriculum(cfg)
    assert cur.tools_for("t0") == {"answer"}
    assert [cur.observe(batch(0)) for _ in range(3)] == [False, False, True]  # min_stay 3 binds
    assert cur.stage == 1 and cur.tools_for("t0") == {"answer", "search"}
    assert cur.events == [
        {"observation": 3, "from": 0, "to": 1, "signal": "unsolved", "tools": ["answer", "search"]}
    ]
    assert cur.metrics()["curriculum/stage"] == 1.0


def test_hysteresis_a_single_bad_batch_does_not_unlock() -> None:
    cfg = CurriculumConfig(
        stages=STAGES, window=10, min_attempts=1, unsolved_threshold=0.5, patience=2, min_stay=0
    )
    cur = ToolCurriculum(cfg)

    def tasks(prefix: str, reward: float) -> list[Trajectory]:
        return [traj(f"{prefix}{i}", reward) for i in range(4)]

    assert cur.observe(tasks("a", 1.0)) is False  # unsolved share 0/4
    assert cur.observe(tasks("b", 0.0)) is False  # 4/8 = 0.5: signal, streak 1
    assert cur.metrics()["curriculum/signal_streak"] == 1.0
    assert cur.observe(tasks("c", 1.0)) is False  # 4/12: no signal, the streak resets
    assert cur.metrics()["curriculum/signal_streak"] == 0.0
    assert cur.observe(tasks("d", 0.0)) is False  # 8/16: signal again, streak 1 only
    assert cur.stage == 0
    assert cur.observe(tasks("e", 0.0)) is True  # 12/20: second consecutive signal unlocks
    assert cur.stage == 1


def test_plateau_unlocks_and_improvement_does_not() -> None:
    cfg = CurriculumConfig(
        stages=STAGES, window=2, plateau_delta=0.1, unsolved_threshold=1.0, patience=1, min_stay=0
    )
    improving = ToolCurriculum(cfg)
    for k in range(4):
        assert improving.observe(batch(k + 1 if k < 3 else 4)) is False  # 0.25, 0.5, 0.75, 1.0
    flat = ToolCurriculum(cfg)
    results = [flat.observe(batch(2)) for _ in range(4)]
    assert results == [False, False, False, True]
    assert flat.events[0]["signal"] == "plateau"


def test_final_stage_stays_and_infra_errors_are_ignored() -> None:
    cfg = CurriculumConfig(stages=STAGES[:2], window=10, min_attempts=1, patience=1, min_stay=0)
    cur = ToolCurriculum(cfg)
    assert cur.observe(batch(0)) is True
    assert all(cur.observe(batch(0)) is False for _ in range(5))
    assert cur.stage == 1
    before = cur.metrics()
    cur.observe([traj("t9", 0.0, status="infra_error")])
    assert cur.unsolved_share() == before["curriculum/unsolved_share"]


def test_resume_gives_identical_decisions() -> None:
    cfg = CurriculumConfig(
        stages=STAGES, window=2, min_attempts=1, patience=2, min_stay=2, preview_prob=0.3, seed=7
    )
    rewards = [
        [0, 0, 1, 0],
        [0, 0, 0, 0],
        [1, 0, 0, 0],
        [0, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 1, 1, 1],
        [0, 0, 0, 0],
    ] * 2

    def run(cur: ToolCurriculum, steps: list[list[int]]) -> list[tuple]:
        out = []
        for rs in steps:
            tools = [tuple(sorted(cur.tools_for(f"t{i}"))) for i in range(4)]
            unlocked = cur.observe([traj(f"t{i}", float(r)) for i, r in enumerate(rs)])
            out.append((tools, unlocked, cur.stage))
        return out

    full = run(ToolCurriculum(cfg), rewards)
    first = ToolCurriculum(cfg)
    head = run(first, rewards[:5])
    saved = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip
    resumed = ToolCurriculum(cfg)
    resumed.load_state_dict(saved)
    assert head + run(resumed, rewards[5:]) == full
    assert any(unlocked for _, unlocked, _ in full)  # the sequence does exercise an unlock


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ConfigError, match="at least one tool"):
        CurriculumConfig(stages=(("answer",), ()))
    with pytest.raises(ConfigError, match="preview_prob"):
        CurriculumConfig(preview_prob=2.0)


# ----------------------------------------------------------------- mid-episode unlock rules
OPEN_AFTER_FAILS = {"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 3}}}
SEARCH_AT_TURN_2 = {"tool": "search", "after": {"turn": 2}, "stage": 0}


def test_reset_options_give_each_stage_its_tools_and_rules() -> None:
    cfg = CurriculumConfig(stages=STAGES, unlocks=(OPEN_AFTER_FAILS, SEARCH_AT_TURN_2))
    cur = ToolCurriculum(cfg)
    # stage 0 lacks search and open: both rules apply (the bound one is for stage 0)
    assert cur.reset_options("t0") == {
        "tools": ["answer"],
        "unlocks": [OPEN_AFTER_FAILS, {"tool": "search", "after": {"turn": 2}}],
    }
    cur.stage = 1  # search from the start; open still unlocks mid-episode
    assert cur.reset_options("t0") == {"tools": ["answer", "search"], "unlocks": [OPEN_AFTER_FAILS]}
    cur.stage = 2  # open from the start: no rule left
    assert cur.reset_options("t0") == {"tools": ["answer", "open", "search"]}


def test_rules_without_stages_apply_to_every_episode() -> None:
    cur = ToolCurriculum(CurriculumConfig(unlocks=(OPEN_AFTER_FAILS,)))
    assert cur.tools_for("t0") is None
    assert cur.reset_options("t0") == {"unlocks": [OPEN_AFTER_FAILS]}
    assert ToolCurriculum(CurriculumConfig()).reset_options("t0") == {}


def test_reset_options_draw_the_preview_like_tools_for() -> None:
    cfg = CurriculumConfig(stages=STAGES, preview_prob=0.5, seed=3, unlocks=(OPEN_AFTER_FAILS,))
    a, b = ToolCurriculum(cfg), ToolCurriculum(cfg)
    drawn = [a.reset_options(f"t{i}") for i in range(20)]
    assert [set(o["tools"]) for o in drawn] == [b.tools_for(f"t{i}") for i in range(20)]
    assert {len(o["tools"]) for o in drawn} == {1, 2}  # some episodes previewed stage 1


def unlocked_traj(task_id: str, tools: dict[str, float]) -> Trajectory:
    metrics = {f"tool/{tool}/unlocked_turn": turn for tool, turn in tools.items()}
    return Trajectory(
        env_id="e",
        task_id=task_id,
        seed=0,
        harness="bare",
        allowed_tools=("answer",),
        messages=(),
        token_ids=(),
        loss_mask=(),
        logprobs=(),
        reward=0.0,
        metrics={"env/unlocks": float(len(tools)), **metrics},
        status="ok",
    )


def test_state_dict_round_trips_with_mid_episode_rules() -> None:
    cfg = CurriculumConfig(
        stages=STAGES,
        window=2,
        min_attempts=1,
        patience=1,
        min_stay=1,
        preview_prob=0.4,
        seed=5,
        unlocks=(OPEN_AFTER_FAILS, SEARCH_AT_TURN_2),
    )
    steps = [
        [unlocked_traj("t0", {"open": 3.0}), unlocked_traj("t1", {})],
        [unlocked_traj("t0", {"open": 2.0, "search": 2.0}), unlocked_traj("t1", {"open": 4.0})],
        [unlocked_traj("t2", {}), unlocked_traj("t3", {"search": 2.0})],
        [unlocked_traj("t0", {"open": 3.0})],
    ]

    def run(cur: ToolCurriculum, batches: list[list[Trajectory]]) -> list[tuple]:
        out = []
        for trajectories in batches:
            options = [cur.reset_options(t.task_id) for t in trajectories]
            out.append((options, cur.observe(trajectories), cur.metrics()))
        return out

    full = run(ToolCurriculum(cfg), steps)
    first = ToolCurriculum(cfg)
    head = run(first, steps[:2])
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["unlock_rules"] == [OPEN_AFTER_FAILS, SEARCH_AT_TURN_2]
    assert saved["unlocked"] == {"open": 3, "search": 1}
    resumed = ToolCurriculum(cfg)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert head + run(resumed, steps[2:]) == full
    assert full[-1][2]["curriculum/unlocked/open"] == 4.0 and full[-1][2]["curriculum/unlocked/search"] == 2.0
    assert any(unlocked for _, unlocked, _ in full)  # the run crosses a stage change
    assert all("unlocks" in o for o in full[0][0])  # and its first episodes carry rules


def test_resume_with_other_unlock_rules_is_refused() -> None:
    saved = ToolCurriculum(CurriculumConfig(stages=STAGES, unlocks=(OPEN_AFTER_FAILS,))).state_dict()
    other = ToolCurriculum(CurriculumConfig(stages=STAGES))
    with pytest.raises(
        ConfigError, match="saved with unlock rules .*resume with the same curriculum.unlocks"
    ):
        other.load_state_dict(saved)
    older = {k: v for k, v in other.state_dict().items() if k not in ("unlock_rules", "unlocked")}
    other.load_state_dict(older)  # a checkpoint from before unlock rules existed still loads


@pytest.mark.parametrize(
    ("unlocks", "message"),
    [
        ((OPEN_AFTER_FAILS | {"stage": 2},), r"stage 2 already allows 'open' from the start"),
        (({"tool": "answer", "after": {"turn": 1}},), "never applies: every stage already allows 'answer'"),
        ((OPEN_AFTER_FAILS | {"stage": 3},), "stage 3 does not exist; the curriculum has 3 stages"),
        ((OPEN_AFTER_FAILS | {"stage": -1},), "stage must be a stage index"),
        (({"tool": "open", "after": {"turns": 2}},), r"unknown rule kind 'turns'\. Did you mean 'turn'\?"),
        (({"tool": "open", "after": {"turn": 0}},), "'turn' must be a whole number >= 1, got 0"),
        (({"tool": "open", "after": {"failed_calls": {"tool": "search", "n": 1.5}}},), "got 1.5"),
        (({"tool": "open", "aftr": {"turn": 2}},), r"unknown key 'aftr'\. Did you mean 'after'\?"),
        ((OPEN_AFTER_FAILS, OPEN_AFTER_FAILS | {"stage": 1}), "stage 1 gets two rules for 'open'"),
        (("open",), r"curriculum.unlocks\[0\] must be a table"),
    ],
)
def test_bad_unlock_rules_fail_at_config_load(unlocks, message) -> None:
    with pytest.raises(ConfigError, match=message):
        CurriculumConfig(stages=STAGES, unlocks=unlocks)


def test_a_stage_bound_rule_needs_stages() -> None:
    with pytest.raises(ConfigError, match="bound to stage 0, but the curriculum has no stages"):
        ToolCurriculum(CurriculumConfig(unlocks=(SEARCH_AT_TURN_2,)))


def test_unlocks_load_from_toml_and_round_trip(tmp_path) -> None:
    from toolgym.training.config import load_config, to_dict

    path = tmp_path / "run.toml"
    path.write_text(
        "[curriculum]\n"
        'stages = [["answer", "search"], ["answer", "search", "open"]]\n'
        'unlocks = [{ tool = "open", after = { failed_calls = { tool = "search", n = 3 } } }]\n',
        encoding="utf-8",
    )
    config = load_config(path)
    assert config.curriculum.unlocks == (OPEN_AFTER_FAILS,)
    assert to_dict(config)["curriculum"]["unlocks"] == [OPEN_AFTER_FAILS]
    with pytest.raises(
        ConfigError, match=r"unknown rule kind 'first_sucess'\. Did you mean 'first_success'\?"
    ):
        load_config(path, ['curriculum.unlocks=[{ tool = "open", after = { first_sucess = "search" } }]'])


async def test_the_trainer_passes_the_rules_to_reset(tmp_path) -> None:
    """A tiny run: every episode is reset with the curriculum's rules (lookup withheld at the start)."""
    from builders import tiny_overrides

    from toolgym.training.config import load_config
    from toolgym.training.trainer import Trainer

    rule = '{ tool = "lookup", after = { turn = 1 } }'
    config = load_config(None, [*tiny_overrides(steps=1), f"curriculum.unlocks=[{rule}]"])
    await Trainer(config, tmp_path).run()
    records = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 8
    for record in records:
        trajectory = record["trajectory"]
        assert trajectory["allowed_tools"] == ["answer"]
        assert '"name": "lookup"' not in trajectory["messages"][0]["content"]
        assert trajectory["metrics"]["env/unlocks"] in (0.0, 1.0)
