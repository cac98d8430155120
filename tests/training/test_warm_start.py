"""Warm start (rejection-sampled fine-tune) and held-out settings: pure pieces and a tiny-model run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from builders import tiny_overrides, trajectory

from toolgym.core import Trajectory
from toolgym.errors import ConfigError
from toolgym.training.config import WarmStartConfig, load_config
from toolgym.training.heldout.table import check_disjoint, heldout_table
from toolgym.training.learn.grpo import TokenFidelityError
from toolgym.training.learn.scoring import token_logprobs
from toolgym.training.tiny_policy import TinyPolicy, tiny_model
from toolgym.training.trainer import Trainer
from toolgym.training.warm_start.demonstrations import _usable, fine_tune, reference_demonstrator

TINY = tiny_overrides()


def test_only_clean_rewarded_episodes_are_kept() -> None:
    ok = trajectory([1, 2, 3], [0, 1, 1], reward=0.6)
    assert _usable(ok, 0.5)
    assert not _usable(trajectory([1, 2, 3], [0, 1, 1], reward=0.4), 0.5)
    assert not _usable(trajectory([1, 2, 3], [0, 1, 1], reward=0.9, status="truncated"), 0.5)
    assert not _usable(trajectory([1, 2, 3], [0, 1, 1], reward=0.9, **{"env/parse_errors": 1.0}), 0.5)
    assert not _usable(trajectory([1, 2, 3], [0, 0, 0], reward=0.9), 0.5)


def test_fine_tune_raises_the_likelihood_of_sampled_tokens_only() -> None:
    torch.manual_seed(0)
    model = TinyPolicy(hidden=32, layers=1, seed=0).model
    prompt, sampled = [5, 6, 7, 8], [9, 10, 11]
    t = trajectory(prompt + sampled, [0] * len(prompt) + [1] * len(sampled))
    with torch.no_grad():
        before, _ = token_logprobs(model, [t.token_ids])
    losses = fine_tune(model, [t], WarmStartConfig(samples=1, epochs=5, lr=0.01, micro_batch=1), seed=0)
    with torch.no_grad():
        after, _ = token_logprobs(model, [t.token_ids])
    assert len(losses) == 5 and losses[-1] < losses[0]
    # the sampled tokens became likelier; the exact loss of epoch 1 is the NLL before any update
    assert float(after[0, len(prompt) :].sum()) > float(before[0, len(prompt) :].sum())
    assert losses[0] == pytest.approx(-float(before[0, len(prompt) :].mean()), rel=1e-5)


def test_fine_tune_reports_every_optimizer_step() -> None:
    model = TinyPolicy(hidden=16, layers=1, seed=0).model
    t = trajectory([5, 6, 7, 8, 9], [0, 0, 1, 1, 1])
    seen: list[tuple[int, int]] = []
    config = WarmStartConfig(samples=1, epochs=2, lr=0.01, micro_batch=2)
    fine_tune(model, [t, t, t], config, seed=0, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]  # 2 micro-batches (2 + 1 episodes) per epoch


def test_fine_tune_refuses_altered_tokens() -> None:
    model = TinyPolicy(hidden=16, layers=1, seed=0).model
    t = trajectory([1, 2, 3], [0, 1, 1])
    altered = Trajectory.from_json(t.to_json().replace('"token_ids": [1, 2, 3]', '"token_ids": [1, 2, 4]'))
    with pytest.raises(TokenFidelityError):
        fine_tune(model, [altered], WarmStartConfig(samples=1), seed=0)


def test_bad_warm_start_and_heldout_settings_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="warm_start.epochs"):
        load_config(None, ["warm_start.epochs=0"])
    with pytest.raises(ConfigError, match="warm_start.temperature"):
        load_config(None, ["warm_start.temperature=0"])
    with pytest.raises(ConfigError, match="heldout.n"):
        load_config(None, ["heldout.n=-1"])
    with pytest.raises(ConfigError, match="heldout.engine"):
        load_config(None, ["heldout.engine=vlm"])
    with pytest.raises(ConfigError, match="Did you mean .samples."):
        load_config(None, ["warm_start.sample=3"])


def test_heldout_refuses_training_tasks() -> None:
    check_disjoint(["a", "b"], ["c", "d"])
    with pytest.raises(ConfigError, match="1 training task"):
        check_disjoint(["a", "b"], ["b", "c"])


def test_heldout_table_shows_each_track() -> None:
    row = {"base": 0.1, "trained": 0.25, "diff": 0.15, "ci": [0.05, 0.26], "base_em": 0.0, "trained_em": 0.1}
    text = heldout_table(
        {
            "env_id": "toolgym/SearchQA-v0",
            "split": "test",
            "n": 100,
            "seed": 0,
            "tracks": [{"harness": "bare", **row}, {"harness": "scaffold", **row}],
        }
    )
    assert "split=test" in text and "n=100" in text
    assert text.count("+0.150") == 2 and "[+0.050, +0.260]" in text


async def test_warm_start_runs_once_and_is_checkpointed(tmp_path: Path) -> None:
    overrides = [*TINY, "warm_start.samples=3", "warm_start.min_reward=0.5", "warm_start.epochs=1"]
    trainer = Trainer(load_config(None, overrides), tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    await trainer.run()
    record = json.loads((tmp_path / "warm_start.json").read_text())
    # 6 toy tasks x 3 samples, every one sampled from the untrained policy
    assert record["sampled"] == 18 and record["tasks"] == 6
    assert 0 <= record["kept"] <= 6 * 2  # keep_per_task = 2
    assert len(record["epoch_losses"]) == (1 if record["kept"] else 0)
    assert trainer.warm_started
    # the warm start bumps the version once, then two RL steps
    assert trainer.policy.policy_version == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    trainer.close()

    # resuming a finished run neither repeats the warm start nor rewrites its record
    stamp = (tmp_path / "warm_start.json").stat().st_mtime_ns
    again = Trainer(load_config(None, overrides), tmp_path)
    assert again.resume() and again.warm_started
    await again.run()
    assert (tmp_path / "warm_start.json").stat().st_mtime_ns == stamp
    again.close()


def test_reference_source_needs_the_env_to_provide_a_rule(tmp_path: Path) -> None:
    trainer = Trainer(
        load_config(None, [*TINY, "warm_start.samples=1", "warm_start.source=reference"]), tmp_path
    )
    try:
        with pytest.raises(ConfigError, match="reference_rule"):
            reference_demonstrator(trainer.config.env.id, dict(trainer.config.env.kwargs), trainer.policy)
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="Did you mean 'reference'"):
        load_config(None, ["warm_start.source=referenc"])


async def test_demonstrations_are_kept_by_the_verifier_and_trained_on(tmp_path: Path) -> None:
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.base import RulePolicy
    from toolgym.training.sampling.workers import make_env
    from toolgym.training.warm_start.demonstrations import rejection_sample

    policy = TinyPolicy(hidden=32, layers=1, seed=0)
    # a demonstrator that answers all letters on even tasks and all digits on odd ones
    answers = {f"w{i}": ("abcdef" if i % 2 == 0 else "123456") for i in range(6)}

    def demonstrator(task_id: str) -> RulePolicy:
        text = f'<tool_call>{{"name": "answer", "arguments": {{"answer": "{answers[task_id]}"}}}}</tool_call>'
        return RulePolicy(lambda _transcript: text, tokenizer=policy.tokenizer)

    episodes, kept = await rejection_sample(
        lambda: make_env("toy_env:toolgym-test/Letters-v0", {}),
        policy,
        get_harness("bare"),
        list(answers),
        WarmStartConfig(samples=1, source="reference", min_reward=0.5),
        seed=0,
        max_tokens=256,
        max_total_tokens=4096,
        policy_for=demonstrator,
    )
    assert len(episodes) == 6
    assert sorted(t.task_id for t in kept) == ["w0", "w2", "w4"]
    assert all(t.reward == 1.0 for t in kept)
    losses = fine_tune(policy.model, kept, WarmStartConfig(samples=1, epochs=2, lr=0.01), seed=0)
    assert len(losses) == 2 and losses[1] < losses[0]


def test_sampled_nll_equals_the_full_forward_pass() -> None:
    from toolgym.training.warm_start.demonstrations import sampled_nll

    model = TinyPolicy(hidden=32, layers=2, seed=1).model
    rows = [
        trajectory([7, 8, 9, 10, 11, 12, 13], [0, 0, 0, 1, 1, 0, 1]),
        trajectory([7, 8, 20, 21], [0, 0, 1, 1]),
        trajectory([30, 31, 32, 33, 34], [0, 1, 0, 0, 1]),
    ]
    nll, tokens = sampled_nll(model, rows)
    with torch.no_grad():
        logp, _ = token_logprobs(model, [t.token_ids for t in rows])
    expected = -sum(
        float(logp[i, j]) for i, t in enumerate(rows) for j, m in enumerate(t.loss_mask) if m and j > 0
    )
    assert tokens == 7
    assert float(nll) == pytest.approx(expected, abs=1e-5)


def test_shared_prefix_fine_tune_gives_the_unshared_loss_and_gradient() -> None:
    from toolgym.training.tiny_policy import tiny_model
    from toolgym.training.warm_start.demonstrations import sampled_nll, shared_nll

    prompt = list(range(40, 90))  # the shared system text / worked turn
    rows = [
        trajectory(prompt + [5, 6, 7, 8, 9], [0] * 50 + [1, 1, 0, 1, 1]),
        trajectory(prompt + [5, 11, 12], [0] * 50 + [1, 1, 1]),
        trajectory(prompt + [20, 21, 22, 23, 24, 25, 26], [0] * 50 + [0, 0, 1, 1, 0, 1, 1]),
    ]
    grads = []
    values = []
    for variant in ("plain", "shared", "shared with checkpointed layers"):
        model = tiny_model(hidden=32, layers=2, seed=5).float()
        if variant == "plain":
            nll, tokens = sampled_nll(model, rows)
            (nll / tokens).backward()
        else:
            nll, tokens, finish = shared_nll(model, rows, checkpoint_layers=variant != "shared")
            (nll / tokens).backward()
            finish()
        values.append((float(nll.detach()), tokens))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert values[0][1] == values[1][1] == values[2][1] == 11
    for value, grad in zip(values[1:], grads[1:], strict=True):
        assert value[0] == pytest.approx(values[0][0], abs=1e-5)
        assert grad.shape == grads[0].shape and float((grads[0] - grad).abs().max()) < 1e-5
    assert float(grads[0].abs().max()) > 1e-3  # the comparison is not between two zero gradients


WARM = ["warm_start.samples=4", "warm_start.min_reward=0.0", "warm_start.epochs=1", "warm_start.lr=0.01"]


async def _warm_started(run: Path, *extra: str) -> Trainer:
    """A tiny run's warm start (and nothing else) into ``run``, from one starting model (as a model file
    on disk would be: the tiny policy is otherwise built from ``train.seed``)."""
    from toolgym.training.sampling.workers import env_factory

    trainer = Trainer(load_config(None, [*TINY, *WARM, *extra]), run)
    trainer.model.load_state_dict(tiny_model(hidden=32, layers=2, seed=0).state_dict())
    trainer.optimizer.reload_masters()
    make, free = env_factory("asyncio", trainer.config.env.id, dict(trainer.config.env.kwargs))
    try:
        await trainer.warm_start(make)
    finally:
        free()
        trainer.close()
    return trainer


async def test_warm_start_seed_lets_another_rl_seed_share_one_warm_start(tmp_path: Path) -> None:
    """``warm_start.seed`` decides the warm start alone: a run with ``train.seed = 1`` and
    ``warm_start.seed = 0`` makes the warm start a ``train.seed = 0`` run makes, and may reuse it; with
    ``train.seed = 1`` alone the reuse is refused, naming the setting that would allow it."""
    from safetensors.torch import save_file

    from toolgym.training.config import to_dict
    from toolgym.training.warm_start.reuse import reuse_warm_start

    a = await _warm_started(tmp_path / "a")
    b = await _warm_started(tmp_path / "b", "train.seed=1", "warm_start.seed=0")
    c = await _warm_started(tmp_path / "c", "train.seed=1")
    assert json.loads((tmp_path / "a" / "warm_start.json").read_text())["kept"] > 0
    same = [torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)]
    assert all(same), "the warm start depends on warm_start.seed, not on train.seed"
    other = [torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters(), strict=True)]
    assert not all(other), "another seed makes another warm start"

    export = tmp_path / "a" / "export" / "step-000000"  # the tiny policy writes no export of its own
    export.mkdir(parents=True)
    state = {k: v.detach().clone().contiguous() for k, v in a.model.state_dict().items()}
    save_file(state, str(export / "model.safetensors"))
    (tmp_path / "a" / "config.json").write_text(json.dumps(to_dict(a.config)))
    with pytest.raises(
        ConfigError, match=r"the warm start's seed: 0 there, 1 here .*set warm_start.seed = 0"
    ):
        reuse_warm_start(tmp_path / "a", load_config(None, [*TINY, *WARM, "train.seed=1"]), c.model)
    again = load_config(None, [*TINY, *WARM, "train.seed=1", "warm_start.seed=0"])
    assert reuse_warm_start(tmp_path / "a", again, c.model).kept > 0
    assert all(torch.equal(p, state[n]) for n, p in c.model.state_dict().items())
    with pytest.raises(ConfigError, match="warm_start.seed must be an integer"):
        load_config(None, ["warm_start.seed='0'"])


async def test_a_warm_start_without_weights_on_disk_is_rebuilt_and_checked_by_its_hash(
    tmp_path: Path,
) -> None:
    """``warm_start.reuse`` of a run that keeps no weights (a run directory without its step-0 export,
    or the run's result file alone, as a study keeps it in the repository) rebuilds the warm start here
    and checks the rebuilt weights against the hash the run recorded; a record whose hash the rebuild
    does not give, or an export whose weights were replaced, stops the run before its first checkpoint."""
    from safetensors.torch import save_file

    from toolgym.training.config import to_dict
    from toolgym.training.run_result import write_run_result
    from toolgym.training.warm_start.identity import weights_sha256

    def record(run: Path) -> dict:
        return json.loads((run / "warm_start.json").read_text())

    a = await _warm_started(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps(to_dict(a.config)))
    made = record(tmp_path / "a")["weights_sha256"]
    assert len(made) == 64 and made == weights_sha256(a.model)
    start = tiny_model(hidden=32, layers=2, seed=0)
    assert weights_sha256(start) != made, "the hash is the warm-started weights'"

    # the tiny policy writes no export: the run keeps no weights, so reusing it rebuilds and checks
    b = await _warm_started(tmp_path / "b", f"warm_start.reuse='{tmp_path / 'a'}'")
    assert record(tmp_path / "b")["weights_sha256"] == made
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))

    # the run's result file alone, in another folder (paths written portably)
    write_run_result(tmp_path / "a")
    kept = tmp_path / "study" / "a.json"
    kept.parent.mkdir()
    kept.write_bytes((tmp_path / "a" / "result.json").read_bytes())
    assert json.loads(kept.read_text())["warm_start"]["weights_sha256"] == made
    await _warm_started(tmp_path / "c", f"warm_start.reuse='{kept}'")
    assert record(tmp_path / "c")["weights_sha256"] == made

    # a recorded hash the rebuild does not give: refused, both hashes named, nothing checkpointed
    forged = {**record(tmp_path / "a"), "weights_sha256": "0" * 64}
    (tmp_path / "a" / "warm_start.json").write_text(json.dumps(forged))
    with pytest.raises(
        ConfigError, match=rf"rebuilt here has weights hash {made[:16]}, the recorded one 0{{16}}"
    ):
        await _warm_started(tmp_path / "d", f"warm_start.reuse='{tmp_path / 'a'}'")
    assert not (tmp_path / "d" / "checkpoint.pt").exists()

    # an export whose weights are not the recorded ones: refused as replaced
    (tmp_path / "a" / "warm_start.json").write_text(json.dumps({**forged, "weights_sha256": made}))
    export = tmp_path / "a" / "export" / "step-000000"
    export.mkdir(parents=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in start.state_dict().items()},
        str(export / "model.safetensors"),
    )
    with pytest.raises(ConfigError, match="its step-0 export's weights have hash .* replaced or damaged"):
        await _warm_started(tmp_path / "e", f"warm_start.reuse='{tmp_path / 'a'}'")

    # no export and no recorded hash (a record from before hashes): nothing to rebuild against
    (tmp_path / "a" / "warm_start.json").write_text(json.dumps({**forged, "weights_sha256": ""}))
    (export / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="nor a recorded weights hash to rebuild it against"):
        await _warm_started(tmp_path / "f", f"warm_start.reuse='{tmp_path / 'a'}'")


def test_the_reference_rule_a_run_uses_is_in_its_manifest_and_an_unknown_one_stops_it(tmp_path: Path) -> None:
    from toolgym.training.step_log import write_train_manifest as write_manifest

    hard = ["env.id='toolgym/SearchQA-v0'", "env.kwargs={ questions = 'hard' }"]
    reference = ["warm_start.samples=1", "warm_start.source=reference"]
    config = load_config(None, [*hard, *reference])
    path = write_manifest(tmp_path, config, {}, ["t0"], model_dir=None, resuming=False)
    assert json.loads(path.read_text())["run"]["reference_rule"] == "reformulate"
    chosen = load_config(None, [*hard, *reference, "env.reference_rule=copy"])
    path = write_manifest(tmp_path, chosen, {}, ["t0"], model_dir=None, resuming=False)
    assert json.loads(path.read_text())["run"]["reference_rule"] == "copy"
    unknown = load_config(None, [*hard, "train.task_pool=reference", "env.reference_rule=reformulating"])
    with pytest.raises(ConfigError, match="Did you mean 'reformulate'"):
        write_manifest(tmp_path, unknown, {}, ["t0"], model_dir=None, resuming=False)
    plain = write_manifest(tmp_path, load_config(None, hard), {}, ["t0"], model_dir=None, resuming=False)
    assert "reference_rule" not in json.loads(plain.read_text())["run"]  # no rule in use: none recorded
