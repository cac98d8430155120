"""The tool curriculum, driven with synthetic results."""

from __future__ import annotations

import json

import pytest

from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.training.curriculum import CurriculumConfig, ToolCurriculum

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
