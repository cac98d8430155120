"""The learner trains every segment of a compacted episode, with the episode's advantage."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from toolgym.agents.harness import get_harness
from toolgym.agents.policies.base import ScriptedPolicy
from toolgym.agents.rollout import run_episode
from toolgym.core import SamplingParams
from toolgym.training.config import load_config
from toolgym.training.sampling.workers import Group
from toolgym.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))
from test_compaction import TURNS, PagesEnv  # noqa: E402


@pytest.mark.parametrize("share", [False, True])
def test_a_learner_step_trains_every_segment(tmp_path: Path, share: bool) -> None:
    def episode(track: str):
        return asyncio.run(
            run_episode(
                PagesEnv(),
                ScriptedPolicy(TURNS),
                get_harness(track),
                seed=0,
                sampling=SamplingParams(max_tokens=200),
                max_total_tokens=2400,
            )
        )

    compacted, failed = episode("bare+compact"), episode("bare")
    assert compacted.reward == 1.0 and failed.reward == 0.0 and len(compacted.segments) >= 2
    overrides = [
        "env.id=toy_env:toolgym-test/Letters-v0",
        "policy.kind=tiny",
        "policy.hidden=32",
        "train.group_size=2",
        "train.batching.micro_batch=2",
        f"train.batching.share_prefix={str(share).lower()}",
    ]
    trainer = Trainer(load_config(None, overrides), tmp_path)
    try:
        learn = asyncio.run(trainer._learn([Group(index=0, task_id="t", trajectories=(compacted, failed))]))
    finally:
        trainer.close()
    # every sampled token of every segment is in the loss, each once
    assert learn.tokens == compacted.metrics["tokens/sampled"] + failed.metrics["tokens/sampled"]
    assert learn.trained == ((True, True),) and learn.grad_norm > 0.0 and learn.updated
    assert learn.sequences == len(compacted.segments) + 1 + 1
    advantage = learn.advantages[0]
    assert advantage[0] > 0 > advantage[1]


def test_the_report_marks_segments_and_plots_them(tmp_path: Path) -> None:
    import json
    from dataclasses import asdict

    from toolgym.training.experiments.report import write_report

    compacted = asyncio.run(
        run_episode(
            PagesEnv(),
            ScriptedPolicy(TURNS),
            get_harness("bare+compact"),
            seed=0,
            sampling=SamplingParams(max_tokens=200),
            max_total_tokens=2400,
        )
    )
    rows = [{"step": 1, "reward/mean": 0.5, "env/segments_mean": 1.0}, {"step": 2, "env/segments_mean": 2.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = {"step": 2, "group": 0, "sample": 0, "advantage": 0.5, "trained": True}
    record["trajectory"] = asdict(compacted)
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(record) + "\n")
    page = write_report(tmp_path).read_text()
    assert f"{1 + len(compacted.segments)} segments" in page and "stopped: answer" in page
    for k, segment in enumerate(compacted.segments, start=2):
        assert f"segment {k} · context compacted before turn {segment.start_turn}" in page
    assert "Context segments per episode" in page
    # every sampled turn is labelled with its own token count, across segments
    assert page.count("sampled tokens (mask 1)") == len(TURNS)
