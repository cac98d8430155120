"""Exact-value tests of the pure training math: advantages, the clipped loss, k3 KL, token receipts, and
the learner's bookkeeping (shaped rewards, step plans, micro-batches, packed tensors, metric sums)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from builders import trajectory

from toolgym.core import Trajectory
from toolgym.training.learn.advantages import group_advantages, has_variance
from toolgym.training.learn.batching import Sample, common_prefix_length, micro_batches, pack_batch
from toolgym.training.learn.grpo import TokenFidelityError, check_token_receipt, plan_step
from toolgym.training.learn.loss import (
    LossConfig,
    LossSums,
    clipped_pg_loss,
    k3_kl,
    mismatch_kl,
    policy_loss,
    token_weights,
)
from toolgym.training.learn.rewards import shaped_reward


def test_group_advantages_normalised_exact() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert adv == [1.0, -1.0, -1.0, 1.0]


def test_group_advantages_mean_only() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]


def test_group_advantages_constant_group_is_zero() -> None:
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("value", [0.2, 0.1, 1 / 3, 0.7, 0.2 + 1e-12])
@pytest.mark.parametrize("size", [3, 6, 7])
def test_group_advantages_non_dyadic_constant_groups_are_exactly_zero(value: float, size: int) -> None:
    # the float mean of six 0.2s is not 0.2: centring leaves about 2.8e-11, which AdamW would turn into
    # a full-size step; equal rewards must give exactly 0, normalised or not
    assert group_advantages([value] * size) == [0.0] * size
    assert group_advantages([value] * size, normalize_std=False) == [0.0] * size
    assert not has_variance([value] * size) and has_variance([value] * (size - 1) + [value + 1e-6])


def test_plan_step_skips_a_non_dyadic_constant_group() -> None:
    flat = [_scored(0.0, metrics={"tool/answer/calls": 1.0, "tool/search/calls": 1.0}) for _ in range(6)]
    plan = plan_step([flat], format_credit=0.2)  # every sample earns the same 0.2 of format credit
    assert plan.zero_variance == 1 and plan.groups == () and plan.advantages == ((0.0,) * 6,)


def test_group_advantages_eps_value() -> None:
    adv = group_advantages([2.0, 0.0], eps=1.0)  # std = 1 -> (±1) / 2
    assert adv == [0.5, -0.5]


def test_group_advantages_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan])


def test_clipped_loss_on_policy_equals_minus_mean_advantage() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    terms = clipped_pg_loss(logp, logp.detach(), torch.tensor([2.0]), torch.tensor([[0, 1, 1]]))
    assert terms.loss.item() == pytest.approx(-2.0)
    assert terms.tokens == 2 and terms.clip_frac == 0.0 and terms.ratio_mean == pytest.approx(1.0)
    terms.loss.backward()
    # d/dlogp of -(ratio * A)/n at ratio 1 is -A/n on mask-1 tokens and exactly 0 elsewhere.
    assert logp.grad.tolist() == [[0.0, -1.0, -1.0]]


def test_clipped_loss_clips_high_and_low() -> None:
    behaviour = torch.zeros((1, 2))
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    mask = torch.ones((1, 2))
    # positive advantage: ratio 1.5 is clipped at 1.2, ratio 0.5 is not (min picks the unclipped 0.5)
    pos = clipped_pg_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2)
    assert pos.loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert pos.clip_frac == pytest.approx(0.5)
    # negative advantage: ratio 0.5 is clipped at 0.8 (-> -0.8 * -1), ratio 1.5 stays (1.5 * -1)
    neg = clipped_pg_loss(logp, behaviour, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    assert neg.loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_clipped_loss_num_tokens_denominator_and_per_token_adv() -> None:
    logp = torch.zeros((2, 2))
    adv = torch.tensor([[1.0, 3.0], [0.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 1]])
    terms = clipped_pg_loss(logp, logp, adv, mask, num_tokens=9)
    assert terms.loss.item() == pytest.approx(-(1 + 3 + 5) / 9)


def test_k3_kl_exact_and_in_loss() -> None:
    logp = torch.tensor([[0.0, math.log(0.5)]])
    ref = torch.tensor([[math.log(0.5), math.log(0.5)]])
    kl = k3_kl(logp, ref)
    assert kl[0, 0].item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl[0, 1].item() == 0.0
    terms = clipped_pg_loss(logp, logp, torch.tensor([0.0]), torch.ones((1, 2)), kl_coef=0.1, logp_ref=ref)
    assert terms.kl == pytest.approx((0.5 - math.log(0.5) - 1) / 2)
    assert terms.loss.item() == pytest.approx(0.1 * terms.kl)


def test_kl_coef_without_reference_is_an_error() -> None:
    with pytest.raises(ValueError, match="logp_ref"):
        clipped_pg_loss(
            torch.zeros((1, 1)), torch.zeros((1, 1)), torch.tensor([1.0]), torch.ones((1, 1)), kl_coef=0.1
        )


class TwoWayBPE:
    """A BPE-like tokenizer with a merge: "ab" is one token (2), though [a, b] = [0, 1] decodes the same."""

    vocab = {"a": 0, "b": 1, "ab": 2, "c": 3}

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text.startswith("ab", i):
                ids.append(2)
                i += 2
            else:
                ids.append(self.vocab[text[i]])
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse[i] for i in ids)


def test_retokenising_a_sample_changes_ids_and_the_receipt_catches_it() -> None:
    tok = TwoWayBPE()
    prompt = tok.encode("c")
    sampled = [0, 1, 3]  # the policy sampled "a", "b", "c" as three tokens
    traj = trajectory(tuple(prompt + sampled), (0, 1, 1, 1))
    check_token_receipt(traj)  # the untouched trajectory passes
    reencoded = tok.encode(tok.decode(sampled))
    assert tok.decode(reencoded) == tok.decode(sampled) and reencoded != sampled  # same text, other ids
    tampered = replace(traj, token_ids=tuple(prompt + reencoded), loss_mask=(0, 1, 1), logprobs=(0.0,) * 3)
    with pytest.raises(TokenFidelityError, match="receipt mismatch"):
        check_token_receipt(tampered)


def test_receipt_rejects_length_mismatch() -> None:
    traj = trajectory((1, 2), (0, 1))
    with pytest.raises(TokenFidelityError, match="equal lengths"):
        check_token_receipt(replace(traj, logprobs=(0.0,)))


# ----------------------------------------------------------------- the learner's bookkeeping


def _scored(reward: float, *, status: str = "ok", n: int = 3, metrics: dict | None = None) -> Trajectory:
    ids = tuple(range(10, 10 + n))
    mask = (0,) + (1,) * (n - 1)
    return replace(
        trajectory(ids, mask),
        reward=reward,
        status=status,
        metrics=metrics or {},
        logprobs=(0.0,) + tuple(-0.5 * (i + 1) for i in range(n - 1)),
    )


def test_shaped_reward_values_and_trainer_reexport() -> None:
    from toolgym.training import trainer

    good = {"tool/answer/calls": 1.0, "tool/search/calls": 2.0, "tool/search/errors": 1.0}
    assert shaped_reward(_scored(0.25, metrics=good), 0.5, "answer") == 0.25 + 0.5
    assert shaped_reward(_scored(0.25, metrics={"tool/answer/calls": 1.0}), 0.5, "answer") == 0.25 + 0.25
    failed = {"tool/answer/calls": 1.0, "tool/search/calls": 1.0, "tool/search/errors": 1.0}
    assert shaped_reward(_scored(0.0, metrics=failed), 0.5, "answer") == 0.25
    assert shaped_reward(_scored(0.0, metrics=good | {"env/parse_errors": 1.0}), 0.5, "answer") == 0.0
    assert shaped_reward(_scored(1.0, metrics=good), 0.0, "answer") == 1.0
    assert trainer.shaped_reward is shaped_reward


def test_plan_step_advantages_infra_errors_and_zero_variance() -> None:
    a, b, broken = _scored(1.0), _scored(0.0, n=5), _scored(0.0, status="infra_error")
    flat1, flat2 = _scored(0.5), _scored(0.5)
    alone = _scored(1.0)
    plan = plan_step([[a, broken, b], [flat1, flat2], [alone, _scored(0.0, status="infra_error")]])
    # group 0: rewards [1, 0] -> ±1 / (0.5 + 1e-6); the infra_error sample gets 0 and never trains
    assert plan.advantages[0] == (0.5 / (0.5 + 1e-6), 0.0, -0.5 / (0.5 + 1e-6))
    assert plan.advantages[1] == (0.0, 0.0) and plan.advantages[2] == (0.0, 0.0)
    assert plan.zero_variance == 2  # the equal-reward group and the single-usable-sample group
    assert [[s.trajectory for s in g] for g in plan.groups] == [[a, b]]
    assert [s.advantage for s in plan.samples] == [plan.advantages[0][0], plan.advantages[0][2]]
    assert plan.tokens == 2 + 4
    kept = plan_step([[flat1, flat2], [alone]], normalize_std=False, skip_zero_variance=False)
    assert kept.zero_variance == 0 and [len(g) for g in kept.groups] == [2, 1]
    assert [s.advantage for s in kept.samples] == [0.0, 0.0, 0.0]


def test_plan_step_uses_the_shaped_reward() -> None:
    answered = _scored(0.0, metrics={"tool/answer/calls": 1.0})
    silent = _scored(0.0)
    assert plan_step([[answered, silent]]).zero_variance == 1
    plan = plan_step([[answered, silent]], format_credit=1.0, normalize_std=False)
    assert plan.advantages == ((0.25, -0.25),)


def test_micro_batches_and_common_prefix_length() -> None:
    samples = [Sample(_scored(0.0), float(i)) for i in range(5)]
    chunks = micro_batches(samples, 2)
    assert [[s.advantage for s in c] for c in chunks] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    with pytest.raises(ValueError, match=">= 1"):
        micro_batches(samples, 0)
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3]]) == 3
    assert common_prefix_length([[1, 2], [1, 2]]) == 2
    assert common_prefix_length([[5, 2], [1, 2]]) == 0
    assert common_prefix_length([[1, 2, 3]]) == 3 and common_prefix_length([]) == 0


def test_micro_batches_by_a_token_budget_go_longest_first_and_stay_under_it() -> None:
    lengths = [3, 9, 5, 9, 2, 4]
    samples = [Sample(_scored(0.0, n=n), float(i)) for i, n in enumerate(lengths)]
    chunks = micro_batches(samples, 3, max_tokens=18)
    # longest first (ties in order); a chunk closes before rows x longest row would pass 18
    assert [[s.advantage for s in c] for c in chunks] == [[1.0, 3.0], [2.0, 5.0, 0.0], [4.0]]
    assert all(len(c) * len(c[0].trajectory.token_ids) <= 18 for c in chunks)
    # after a 5-token shared prefix only the suffix counts (from the last shared token): 5, 5, 1, ...
    assert [len(c) for c in micro_batches(samples, 6, max_tokens=10, shared=5)] == [2, 4]
    # a sample over the budget goes alone; the count still caps a chunk; 0 = the count alone
    assert [len(c) for c in micro_batches(samples, 6, max_tokens=8)] == [1, 1, 1, 2, 1]
    assert [len(c) for c in micro_batches(samples, 2, max_tokens=1000)] == [2, 2, 2]
    assert micro_batches(samples, 4, max_tokens=0) == micro_batches(samples, 4)


def test_pack_batch_exact_tensors() -> None:
    short = replace(trajectory((7, 8, 9), (0, 1, 1)), logprobs=(0.0, -0.25, -0.5))
    long = replace(trajectory((7, 8, 1, 2, 3), (0, 0, 1, 0, 1)), logprobs=(0.0, 0.0, -1.0, 0.0, -2.0))
    batch = pack_batch([Sample(short, 1.5), Sample(long, -0.5)])
    assert batch.sequences == ((7, 8, 9), (7, 8, 1, 2, 3))
    assert batch.behaviour.tolist() == [[0.0, -0.25, -0.5, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0, -2.0]]
    assert batch.mask.tolist() == [[0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 1.0]]
    assert batch.mask.dtype == torch.float32 and batch.behaviour.dtype == torch.float32
    assert batch.advantages.tolist() == [1.5, -0.5]
    with pytest.raises(ValueError, match="at least one"):
        pack_batch([])


def test_loss_sums_and_mismatch_kl_add_up_over_micro_batches() -> None:
    behaviour = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])
    logp = torch.tensor([[-3.0, math.log(0.25), math.log(0.25)]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    # k3(behaviour -> learner) on token 1: r = log(0.25) - log(0.5); token 2 is 0; token 0 is masked out
    expected = (0.5 - math.log(0.5) - 1) / 4
    assert mismatch_kl(behaviour, logp, mask, 4) == pytest.approx(expected)
    terms = clipped_pg_loss(logp, behaviour, torch.tensor([1.0]), mask, num_tokens=4)
    sums = LossSums().add(terms, 0.125).add(terms, 0.25)
    assert sums.pg == 2 * terms.pg and sums.clip_frac == 2 * terms.clip_frac
    assert sums.ratio_mean == 2 * terms.ratio_mean and sums.kl == 0.0
    assert sums.as_dict()["mismatch_kl"] == 0.375


# ----------------------------------------------------------------------------- loss variants
def _variant(**kwargs) -> LossConfig:
    return LossConfig(**{"clip_high": 0.2, **kwargs})  # a symmetric clip keeps the expected values simple


def test_token_weights_token_mean_seq_mean_and_constant() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 0, 0]])
    token = token_weights(mask, "token_mean", step_tokens=8, step_sequences=4)
    assert token.tolist() == [[1 / 8, 1 / 8, 1 / 8, 0.0], [0.0, 1 / 8, 0.0, 0.0]]
    seq = token_weights(mask, "seq_mean", step_tokens=8, step_sequences=4)  # each row's mean, over 4 rows
    assert seq.flatten().tolist() == pytest.approx([1 / 12, 1 / 12, 1 / 12, 0.0, 0.0, 1 / 4, 0.0, 0.0])
    constant = token_weights(mask, "constant", step_tokens=8, step_sequences=4, constant_norm=10)
    assert constant.flatten().tolist() == pytest.approx([1 / 40, 1 / 40, 1 / 40, 0.0, 0.0, 1 / 40, 0.0, 0.0])
    with pytest.raises(ValueError, match="unknown aggregation"):
        token_weights(mask, "mean", step_tokens=8, step_sequences=4)


def test_seq_mean_weighs_sequences_not_tokens() -> None:
    # on-policy (ratio 1): the loss is -sum(A * w); a 3-token sequence with A = 1 and a 1-token one
    # with A = -1 cancel under seq_mean and do not under token_mean
    logp = torch.zeros((2, 3), requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -1.0])
    for agg, expected in (
        ("token_mean", -(3 - 1) / 4),
        ("seq_mean", -(1 - 1) / 2),
        ("constant", -(3 - 1) / (2 * 5)),
    ):
        w = token_weights(mask, agg, step_tokens=4, step_sequences=2, constant_norm=5)
        terms = policy_loss(logp, logp.detach(), adv, mask, w, _variant(agg=agg, constant_norm=5))
        assert terms.loss.item() == pytest.approx(expected), agg


def test_sequence_ratio_is_the_exp_of_the_mean_log_ratio_and_clips_whole() -> None:
    behaviour = torch.zeros((1, 2))
    logp = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)  # token ratios 2 and 1
    mask = torch.ones((1, 2))
    w = token_weights(mask, "seq_mean", step_tokens=2, step_sequences=1)
    config = _variant(agg="seq_mean", ratio="sequence", clip_low=0.2, clip_high=10.0)
    terms = policy_loss(logp, behaviour, torch.tensor([1.0]), mask, w, config)
    s = math.sqrt(2.0)  # exp(mean(log 2, 0))
    assert terms.loss.item() == pytest.approx(-s) and terms.ratio_mean == pytest.approx(s)
    terms.loss.backward()
    # d(-s)/dlogp_t = -s / |y| for every token of the sequence, whatever its own ratio
    assert logp.grad.flatten().tolist() == pytest.approx([-s / 2, -s / 2])
    clipped = policy_loss(
        logp, behaviour, torch.tensor([1.0]), mask, w, _variant(agg="seq_mean", ratio="sequence")
    )
    assert clipped.loss.item() == pytest.approx(-1.2) and clipped.clip_frac == pytest.approx(1.0)


def test_dual_clip_caps_negative_advantage_tokens() -> None:
    behaviour = torch.zeros((1, 2))
    logp = torch.tensor([[math.log(5.0), math.log(1.5)]])  # ratios 5 and 1.5
    mask = torch.ones((1, 2))
    w = token_weights(mask, "token_mean", step_tokens=2, step_sequences=1)
    plain = policy_loss(logp, behaviour, torch.tensor([-1.0]), mask, w, _variant())
    assert plain.loss.item() == pytest.approx((5.0 + 1.5) / 2)
    dual = policy_loss(logp, behaviour, torch.tensor([-1.0]), mask, w, _variant(dual_clip=3.0))
    assert dual.loss.item() == pytest.approx((3.0 + 1.5) / 2) and dual.dual_frac == pytest.approx(0.5)
    positive = policy_loss(logp, behaviour, torch.tensor([1.0]), mask, w, _variant(dual_clip=3.0))
    assert positive.dual_frac == 0.0  # only negative advantages are capped


def test_truncated_importance_sampling_weights_and_gradient() -> None:
    # learner logprobs above the sampler's by log 4 and by log 0.5: weights min(4, 2) = 2 and 0.5
    behaviour = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(4.0), math.log(0.5)]], requires_grad=True)
    mask = torch.ones((1, 2))
    w = token_weights(mask, "token_mean", step_tokens=2, step_sequences=1)
    terms = policy_loss(logp, behaviour, torch.tensor([1.0]), mask, w, _variant(tis_cap=2.0))
    # the ratio is taken against the learner's own (detached) logprobs: 1 in value
    assert terms.loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert terms.tis_frac == pytest.approx(0.5) and terms.clip_frac == 0.0
    terms.loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("loss_agg", "tokenmean", "Did you mean 'token_mean'"),
        ("ratio", "seq", "Did you mean 'sequence'"),
        ("lr_schedule", "cosin", "Did you mean 'cosine'"),
        ("tis_cap", "1.0", "tis_cap must be > 1"),
        ("tis_cap", "0.5", "tis_cap must be > 1"),
        ("dual_clip", "1.0", "dual_clip must be > 1"),
        ("task_filter", "passrate", "Did you mean 'pass_rate'"),
        ("warmup_steps", "-1", "warmup_steps must be >= 0"),
        ("lr", "-1e-5", "lr must be >= 0"),
    ],
)
def test_bad_learner_settings_are_clear_errors(key: str, value: str, message: str) -> None:
    from toolgym.errors import ConfigError
    from toolgym.training.config import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"train.{key}={value}"])


def test_a_step_budget_below_the_groups_per_step_is_refused() -> None:
    from toolgym.errors import ConfigError
    from toolgym.training.config import load_config

    with pytest.raises(ConfigError, match="could never fill"):
        load_config(
            None, ["train.dynamic_sampling=true", "train.tasks_per_step=4", "train.max_groups_per_step=3"]
        )
    assert (
        load_config(None, ["train.dynamic_sampling=true", "train.tasks_per_step=4"]).train.group_budget == 12
    )
    assert load_config(None, ["train.tasks_per_step=4"]).train.group_budget == 4


def test_a_runs_step_settings_are_its_loss_and_batching_tables_at_the_sampling_temperature() -> None:
    from toolgym.training.config import load_config
    from toolgym.training.learn.grpo import StepSettings

    config = load_config(
        None,
        [
            "train.batching.micro_batch=3",
            "train.batching.micro_batch_tokens=4096",
            "train.batching.share_prefix=false",
            "train.batching.checkpoint_layers=true",
            "train.loss.clip_high=0.3",
        ],
    )
    reference = torch.nn.Linear(1, 1)
    settings = StepSettings.of(config.train, temperature=0.7, reference=reference)
    assert (settings.micro_batch, settings.micro_batch_tokens, settings.temperature) == (3, 4096, 0.7)
    assert (settings.share_prefix, settings.checkpoint_layers, settings.share_across_groups) == (
        False,
        True,
        True,
    )
    assert settings.loss == config.train.loss and settings.loss.clip_high == 0.3
    assert settings.reference is reference
