"""Exact-value tests of the pure training math: advantages, the clipped loss, k3 KL, token receipts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from toolgym.core import Trajectory, sampled_ids_hash
from toolgym.training.advantages import group_advantages
from toolgym.training.loss import TokenFidelityError, check_token_receipt, clipped_pg_loss, k3_kl


def test_group_advantages_normalised_exact() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], eps=0.0)
    assert adv == [1.0, -1.0, -1.0, 1.0]


def test_group_advantages_mean_only() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=False) == [0.75, -0.25, -0.25, -0.25]


def test_group_advantages_constant_group_is_zero() -> None:
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]


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


def _trajectory(token_ids: tuple[int, ...], mask: tuple[int, ...]) -> Trajectory:
    return Trajectory(
        env_id="x",
        task_id="t",
        seed=0,
        harness="bare",
        allowed_tools=(),
        messages=(),
        token_ids=token_ids,
        loss_mask=mask,
        logprobs=(0.0,) * len(token_ids),
        reward=1.0,
        metrics={},
        status="ok",
        token_hash=sampled_ids_hash(token_ids, mask),
    )


def test_retokenising_a_sample_changes_ids_and_the_receipt_catches_it() -> None:
    tok = TwoWayBPE()
    prompt = tok.encode("c")
    sampled = [0, 1, 3]  # the policy sampled "a", "b", "c" as three tokens
    traj = _trajectory(tuple(prompt + sampled), (0, 1, 1, 1))
    check_token_receipt(traj)  # the untouched trajectory passes
    reencoded = tok.encode(tok.decode(sampled))
    assert tok.decode(reencoded) == tok.decode(sampled) and reencoded != sampled  # same text, other ids
    tampered = replace(traj, token_ids=tuple(prompt + reencoded), loss_mask=(0, 1, 1), logprobs=(0.0,) * 3)
    with pytest.raises(TokenFidelityError, match="receipt mismatch"):
        check_token_receipt(tampered)


def test_receipt_rejects_length_mismatch() -> None:
    traj = _trajectory((1, 2), (0, 1))
    with pytest.raises(TokenFidelityError, match="equal lengths"):
        check_token_receipt(replace(traj, logprobs=(0.0,)))
