"""The data-parallel learner (whole copies, or FSDP2 shards): two gloo learner processes against one,
a killed learner, bad settings.

Real processes, a real gloo process group on CPU, the real trainer on the toy Letters environment
(tiny byte model) and on the embedded SmolLM2 model; the pure sharding logic is checked in-process.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides, trajectory

from toolgym.errors import ConfigError
from toolgym.training.config import load_config
from toolgym.training.distributed.learners import (
    FAULT_ENV,
    LearnerGroup,
    check_learners,
    fingerprint,
    shard_groups,
    shard_plan,
)
from toolgym.training.learn.grpo import StepSettings, accumulate_gradients, plan_step
from toolgym.training.learn.loss import LossConfig
from toolgym.training.tiny_policy import tiny_model

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parents[1]
# lr 1e-3: two ranks sum gradients in another order than one process, so parameters differ by float
# rounding scaled by the step; at this lr that stays under 1e-6 after two steps.
OVERRIDES = [
    *tiny_overrides(steps=3, tasks_per_step=3, group_size=4),
    "train.optim.lr=0.001",
    "train.checkpoint_every=1",
    "train.seed=5",
    "heldout.n=0",
]


def train(
    run_dir: Path, *extra: str, env: dict[str, str] | None = None, torchrun: int = 0
) -> subprocess.CompletedProcess:
    environ = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    if torchrun:  # torchrun's ranks prove a secret the user exports on every node
        environ.setdefault("TOOLGYM_LEARNER_SECRET", secrets.token_hex(32))
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    return subprocess.run(
        [*head, "-m", "toolgym", "train", "--out", str(run_dir), *OVERRIDES, *extra],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=600,
    )


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["model"]


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def samples(run_dir: Path) -> list[tuple]:
    records = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["group"], r["sample"], r["advantage"], tuple(r["trajectory"]["token_ids"]))
        for r in records
    ]


# ---------------------------------------------------------------------- pure logic
def test_groups_are_balanced_by_tokens_and_every_group_lands_once() -> None:
    sizes = [900, 100, 500, 450, 50, 400]
    shards = shard_groups(sizes, 2)
    assert sorted(g for s in shards for g in s) == list(range(6))
    loads = [sum(sizes[g] for g in s) for s in shards]
    assert loads == [1300, 1100]  # largest first, each to the lighter rank
    assert max(loads) - min(loads) <= max(sizes)  # greedy's bound: never worse than one group
    assert shard_groups(sizes, 2) == shards  # deterministic
    assert shard_groups([10], 3) == [[0], [], []]  # a rank may get nothing this step


def test_the_ranks_gradients_sum_to_the_one_process_gradient() -> None:
    """Each rank's share, weighted by the whole step's token count, sums to the unsharded gradient."""
    torch.manual_seed(0)
    groups = []
    for g in range(3):
        base = [1, 2, 3, 4 + g]
        groups.append(
            [
                trajectory([*base, 5 + i, 6 + g + i, 7], [0, 0, 0, 0, 1, 1, 1], reward=float(i % 2) + 0.1 * g)
                for i in range(4)
            ]
        )
    plan = plan_step(groups)
    settings = StepSettings(loss=LossConfig(), micro_batch=2, temperature=1.0)

    def grads(model: torch.nn.Module, part=None, **kw) -> list[torch.Tensor]:
        model.zero_grad()
        accumulate_gradients(model, part or plan, settings, **kw)
        return [p.grad.clone() for p in model.parameters()]

    model = tiny_model(hidden=16, layers=1, seed=1)
    whole = grads(model)
    parts = [
        grads(model, shard_plan(plan, r, 2), step_tokens=plan.tokens, step_sequences=len(plan.samples))
        for r in range(2)
    ]
    assert all(len(shard_plan(plan, r, 2).groups) for r in range(2))
    for full, a, b in zip(whole, *parts, strict=True):
        torch.testing.assert_close(a + b, full, rtol=1e-5, atol=1e-7)
    alone = grads(model, shard_plan(plan, 0, 2))  # the shard's own denominator: not the step's gradient
    assert any(not torch.allclose(x, y, rtol=1e-3) for x, y in zip(alone, parts[0], strict=True))


def test_the_fingerprint_tells_copies_apart() -> None:
    a, b = tiny_model(hidden=16, layers=1, seed=1), tiny_model(hidden=16, layers=1, seed=1)
    assert torch.equal(fingerprint(a), fingerprint(b))
    with torch.no_grad():
        next(b.parameters()).view(-1)[0] += 1e-6
    assert not torch.equal(fingerprint(a), fingerprint(b))


# ---------------------------------------------------------------------- bad settings
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.learners.count=4", r"more than train.tasks_per_step \(3\)"),
        ("train.learners.count=0", "train.learners.count must be >= 1"),
        ("train.learners.backend=glooo", "Did you mean 'gloo'"),
        ("train.learners.timeout=0", "train.learners.timeout must be > 0"),
    ],
)
def test_learner_settings_are_checked_at_start(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*OVERRIDES, override])


def test_sharding_settings_are_checked_at_start() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'fsdp2'"):
        load_config(None, [*OVERRIDES, "train.learners.shard=fsdp"])
    with pytest.raises(ConfigError, match="train.learners.shard = 'fsdp2' with LoRA"):
        load_config(None, [*OVERRIDES, "train.learners.shard=fsdp2", "train.lora.rank=4"])
    with pytest.raises(
        ConfigError, match=r"'fsdp2' with 1 learner \(train.learners.count\): sharding splits"
    ):
        LearnerGroup(1, shard="fsdp2")


def test_a_kl_reference_with_several_learners_is_refused() -> None:
    with pytest.raises(ConfigError, match="train.loss.kl_coef > 0 with train.learners.count > 1"):
        load_config(None, [*OVERRIDES, "train.learners.count=2", "train.loss.kl_coef=0.1"])


def test_torchruns_world_size_is_checked_against_the_config_too(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    group = LearnerGroup(1)  # the config says one; torchrun's four decide
    assert group.world == 4 and group.external
    with pytest.raises(ConfigError, match=r"4 learner processes \(torchrun's world size\)"):
        group.check_config(load_config(None, OVERRIDES).train)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="kl_coef > 0 with several learners"):
        LearnerGroup(1).check_config(load_config(None, [*OVERRIDES, "train.loss.kl_coef=0.1"]).train)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.learners.nodes=anywhere"], "Did you mean 'any'"),
        (["train.learners.nodes=any"], "needs train.rollouts.backend = 'ray'"),
        (
            ["train.rollouts.backend=ray", "train.learners.resources={learner_slot=1}"],
            "set train.learners.nodes = 'any' too",
        ),
        (
            [
                "train.rollouts.backend=ray",
                "train.learners.nodes=any",
                "train.learners.resources={learner_slot=0}",
            ],
            r"train.learners.resources.learner_slot must be a number > 0",
        ),
        (
            [
                "train.rollouts.backend=ray",
                "train.learners.nodes=any",
                "train.learners.resources={learner_slot='x'}",
            ],
            "must be a number > 0",
        ),
    ],
)
def test_learner_placement_settings_are_checked_at_start(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*OVERRIDES, *overrides])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_nccl_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="'nccl' needs CUDA"):
        check_learners(2, "nccl", "cpu")


def test_a_learner_process_that_cannot_start_stops_the_run_with_its_log(tmp_path: Path, monkeypatch) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no torch in this interpreter' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(broken))
    group = LearnerGroup(2, log_dir=tmp_path / "learners")
    with pytest.raises(ConfigError, match=r"rank 1 exited \(exit code 3\) before it joined(.|\n)*no torch"):
        group.start()
    assert not group.started and not group.children


# ---------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_two_learners_train_the_weights_one_learner_trains(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    ok(train(one))
    ok(train(two, "--learners", "2"))
    assert max_gap(params(one), params(two)) < 1e-6
    assert [m["learners"] for m in metrics(two)] == [2.0, 2.0, 2.0]
    assert "learners" not in metrics(one)[0]
    # the same groups were sampled (the ranks' weights agree, so sampling does too) ...
    assert samples(one) == samples(two)
    # ... and both ranks hold the same weights: the run compares their fingerprints at every step
    # and at the end (LearnersDiverged otherwise), so a finished run is the evidence
    assert (two / "learners" / "rank-1.log").exists()


@pytest.mark.slow
def test_torchrun_runs_the_same_data_parallel_training(tmp_path: Path) -> None:
    one, ranked, sharded = tmp_path / "one", tmp_path / "torchrun", tmp_path / "torchrun-fsdp2"
    ok(train(one))
    ok(train(ranked, torchrun=2))
    assert [m["learners"] for m in metrics(ranked)] == [2.0, 2.0, 2.0]
    assert max_gap(params(one), params(ranked)) < 1e-6
    ok(train(sharded, "train.learners.shard=fsdp2", torchrun=2))
    assert [m["learners/held_share"] for m in metrics(sharded)] == [0.5, 0.5, 0.5]
    assert max_gap(params(one), params(sharded)) < 1e-6


def optimizer_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)["optimizer"]


@pytest.mark.slow
def test_fsdp2_learners_train_the_weights_one_learner_trains(tmp_path: Path) -> None:
    """Two FSDP2-sharded gloo learners against one whole learner: same samples, same weights."""
    one, two = tmp_path / "one", tmp_path / "fsdp2"
    ok(train(one))
    ok(train(two, "train.learners.shard=fsdp2", "--learners", "2"))
    assert max_gap(params(one), params(two)) < 1e-6
    assert samples(one) == samples(two)
    rows = metrics(two)
    assert [m["learners"] for m in rows] == [2.0, 2.0, 2.0]
    assert [m["learners/held_share"] for m in rows] == [0.5, 0.5, 0.5]  # each rank holds half
    assert [m["loss/grad_norm"] for m in rows] == [
        pytest.approx(m["loss/grad_norm"], rel=1e-5) for m in metrics(one)
    ]
    # the checkpoint's optimizer state is gathered into the one-process format: whole tensors
    a, b = optimizer_state(one), optimizer_state(two)
    assert a["steps"] == b["steps"] == 3
    for i, state in a["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            other = b["optimizer"]["state"][i][key]
            assert type(other) is torch.Tensor and other.shape == state[key].shape
            assert float((other - state[key]).abs().max()) < 1e-7


@pytest.mark.slow
def test_a_killed_fsdp2_learner_stops_the_run_and_it_resumes_at_any_size(tmp_path: Path) -> None:
    full, killed, other = tmp_path / "full", tmp_path / "killed", tmp_path / "other"
    sharded = ["train.learners.shard=fsdp2", "--learners", "2"]
    ok(train(full, *sharded))
    out = train(killed, *sharded, env={FAULT_ENV: "1:2"})  # rank 1 dies as step 2 arrives
    assert out.returncode == 2, out.stderr[-3000:]
    assert "learner rank 1 exited (SIGKILL) during learner step 2" in out.stderr
    assert len(metrics(killed)) == 1
    ok(train(killed, *sharded))  # the same command resumes, exactly
    assert samples(killed) == samples(full)
    assert max_gap(params(full), params(killed)) == 0.0
    # a sharded run's checkpoint resumes on one whole learner (the state is gathered, no trace of shards)
    out = train(other, *sharded, env={FAULT_ENV: "1:2"})
    assert out.returncode == 2
    out = ok(train(other))
    assert "resuming a checkpoint written with 2 learner(s) on 1" in out.stderr + out.stdout
    assert max_gap(params(full), params(other)) < 1e-6


@pytest.mark.slow
def test_learners_as_ray_actors_train_the_same_weights_and_a_dead_actor_stops_the_run(tmp_path: Path) -> None:
    one, two, killed = tmp_path / "one", tmp_path / "ray", tmp_path / "killed"
    on_ray = ["train.rollouts.ray_env_actors=1", "--learners", "2", "--backend", "ray"]
    ok(train(one))
    ok(train(two, *on_ray))  # environments and learner rank 1 in Ray actors
    assert max_gap(params(one), params(two)) < 1e-6
    assert samples(one) == samples(two)
    assert [m["learners"] for m in metrics(two)] == [2.0, 2.0, 2.0]
    assert (two / "learners" / "rank-1.log").exists()
    out = train(killed, *on_ray, env={FAULT_ENV: "1:2"})  # the actor's process dies as step 2 arrives
    assert out.returncode == 2, out.stderr[-3000:]
    assert "learner rank 1 exited (its Ray actor died" in out.stderr
    assert "during learner step 2" in out.stderr and "rerun the same command to resume" in out.stderr
    ok(train(killed, *on_ray))  # the same command resumes
    assert max_gap(params(two), params(killed)) == 0.0


@pytest.mark.slow
def test_a_learner_actor_on_another_ray_node_trains_the_same_weights(tmp_path: Path) -> None:
    """A two-node Ray cluster on this machine (Ray's own test cluster: two raylets): the learner actor
    is placed by a custom resource that only the second node has, and meets rank 0 at its address."""
    from ray.cluster_utils import Cluster

    one, two, short = tmp_path / "one", tmp_path / "two", tmp_path / "short"
    store = {"object_store_memory": 80 * 2**20}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, **store}
    )
    try:
        cluster.add_node(num_cpus=0, resources={"learner_slot": 1}, **store)
        cluster.wait_for_nodes()
        on_nodes = [
            *[
                "train.rollouts.ray_env_actors=1",
                "train.learners.nodes=any",
                "train.learners.resources={learner_slot=1}",
            ],
            *["--learners", "2", "--backend", "ray"],
        ]
        at = {"RAY_ADDRESS": cluster.address}
        ok(train(one))
        ok(train(two, *on_nodes, env=at))
        assert max_gap(params(one), params(two)) < 1e-6
        assert samples(one) == samples(two)
        placed = json.loads((two / "learners" / "placement.json").read_text())
        assert placed["ranks"]["1"]["node_id"] != placed["trainer"]["node_id"]  # the other node
        assert placed["master_addr"] == placed["trainer"]["address"] != "127.0.0.1"
        assert placed["ranks"]["1"]["log"] == str(two / "learners" / "rank-1.log")  # a shared disk here
        # a resource no node has is refused by name before any actor waits for it
        out = train(short, *on_nodes[:2], "train.learners.resources={gpu_box=2}", *on_nodes[3:], env=at)
        assert out.returncode == 2, out.stderr[-3000:]
        assert "1 learner actor(s) need gpu_box=2 in all, and the Ray cluster has gpu_box=0" in out.stderr
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_a_killed_learner_stops_the_run_and_the_rerun_resumes_exactly(tmp_path: Path) -> None:
    full, killed = tmp_path / "full", tmp_path / "killed"
    ok(train(full, "--learners", "2"))
    out = train(killed, "--learners", "2", env={FAULT_ENV: "1:2"})  # rank 1 dies as step 2 arrives
    assert out.returncode == 2, out.stderr[-3000:]
    assert "learner rank 1 exited (SIGKILL) during learner step 2" in out.stderr
    assert "rerun the same command to resume" in out.stderr
    assert len(metrics(killed)) == 1  # step 1 finished and was checkpointed; step 2 never was
    ok(train(killed, "--learners", "2"))  # the same command
    assert samples(killed) == samples(full)
    strip = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics(killed)]
    assert strip == [{k: v for k, v in m.items() if not k.startswith("time/")} for m in metrics(full)]
    assert max_gap(params(full), params(killed)) == 0.0


@pytest.mark.slow
def test_a_checkpoint_resumes_at_another_number_of_learners(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = train(run, "--learners", "2", env={FAULT_ENV: "1:2"})
    assert out.returncode == 2
    out = ok(train(run, "--learners", "1"))
    assert "resuming a checkpoint written with 2 learner(s) on 1" in out.stderr + out.stdout
    assert [m["step"] for m in metrics(run)] == [1.0, 2.0, 3.0]
    ok(train(tmp_path / "one"))
    assert max_gap(params(tmp_path / "one"), params(run)) < 1e-6


@pytest.mark.slow
@pytest.mark.model
def test_two_learners_on_the_embedded_model(tmp_path: Path) -> None:
    """The embedded SmolLM2-135M (hf policy): two gloo learners against one, two steps.

    Three whole runs of a 135M model on CPU, so it stays among the long tests; its one checkpoint is
    written at the end (a checkpoint of this model and its optimizer is 1.6 GB: one per step tripled
    the test's disk traffic for nothing it checks)."""
    model_args = [
        "train.checkpoint_every=0",
        "policy.kind=hf",
        "policy.threads=1",
        "sampling.max_tokens=8",
        "train.steps=2",
        "train.group_size=2",
        "train.tasks_per_step=2",
        "train.optim.lr=1e-6",
        "train.batching.micro_batch=2",
    ]
    one, two, sharded = tmp_path / "one", tmp_path / "two", tmp_path / "fsdp2"
    ok(train(one, *model_args))
    ok(train(two, *model_args, "--learners", "2"))
    assert [m["learners"] for m in metrics(two)] == [2.0, 2.0]
    assert samples(one) == samples(two)
    assert max_gap(params(one), params(two)) < 1e-6
    # FSDP2 over the 30 decoder layers and the root (tied embedding and output head)
    ok(train(sharded, *model_args, "train.learners.shard=fsdp2", "--learners", "2"))
    assert [m["learners/held_share"] for m in metrics(sharded)] == [0.5, 0.5]
    assert samples(one) == samples(sharded)
    assert max_gap(params(one), params(sharded)) < 1e-6
