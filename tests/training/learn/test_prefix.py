"""Shared-prefix scoring gives the unshared computation's logprobs, loss and gradients (float32, 1e-5).

The reference computation is the learner's original path: a full forward pass over each right-padded
micro-batch (``token_logprobs``), the clipped loss divided by the step's token count, backward per
micro-batch. The shared path scores the same samples through :class:`SequenceScorer` and finishes with
its one backward through the prefix.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch
from builders import trajectory

from toolgym.training.learn.batching import Sample, micro_batches, pack_batch
from toolgym.training.learn.loss import clipped_pg_loss, mismatch_kl
from toolgym.training.learn.scoring import SequenceScorer, token_logprobs
from toolgym.training.tiny_policy import tiny_model
from toolgym.training.trainer import Trainer

TOL = 1e-5


def _sample(ids: Sequence[int], mask: Sequence[int], advantage: float, seed: int) -> Sample:
    """A trajectory with made-up behaviour logprobs on its sampled tokens (a valid token receipt)."""
    rng = random.Random(seed)
    logprobs = [-rng.uniform(0.05, 3.0) if m else 0.0 for m in mask]
    return Sample(trajectory(ids, mask, logprobs=logprobs, reward=0.0), advantage)


def _group(vocab: int, prefix_len: int, suffix_lens: Sequence[int], *, seed: int = 0) -> list[Sample]:
    """A prompt shared by every sample, then per-sample turns: sampled (mask 1) and tool output (mask 0).

    The first two sampled tokens are the same in every sample, so the common prefix ends inside the
    sampled region (mask-1 tokens in the shared part), as when samples agree on ``<tool_call>``.
    """
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(prefix_len)]
    agreed = [rng.randrange(vocab) for _ in range(2)]
    samples = []
    for i, n in enumerate(suffix_lens):
        own = [rng.randrange(vocab) for _ in range(n)]
        if own:
            own[0] = (agreed[-1] + 1 + i) % vocab  # samples diverge right after the agreed tokens
        ids = prompt + agreed + own
        mask = [0] * prefix_len + [1] * 2 + [1 if (j // 5) % 2 == 0 else 0 for j in range(n)]
        samples.append(_sample(ids, mask, advantage=(-1.0) ** i * (0.5 + i / 10), seed=seed + i))
    return samples


def _loss_and_grads(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    *,
    share: bool,
    micro_batch: int,
    temperature: float,
    reference: torch.nn.Module | None = None,
) -> tuple[float, float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = sum(sum(s.trajectory.loss_mask) for s in samples)
    seqs = [s.trajectory.token_ids for s in samples]
    loss = mismatch = 0.0
    masks = [s.trajectory.loss_mask for s in samples]
    if share:
        scorer = SequenceScorer(model, seqs, temperature=temperature, masks=masks)
        ref = (
            None
            if reference is None
            else SequenceScorer(reference, seqs, temperature=temperature, grad=False, masks=masks)
        )
        assert scorer.shared > 0
    for chunk in micro_batches(samples, micro_batch):
        batch = pack_batch(chunk)
        if share:
            read = [s.trajectory.loss_mask for s in chunk]
            logp = scorer.logprobs(batch.sequences, read)
            logp_ref = None if ref is None else ref.logprobs(batch.sequences, read)
        else:
            logp, _ = token_logprobs(model, batch.sequences, temperature=temperature)
            logp_ref = None
            if reference is not None:
                with torch.no_grad():
                    logp_ref, _ = token_logprobs(reference, batch.sequences, temperature=temperature)
        terms = clipped_pg_loss(
            logp,
            batch.behaviour,
            batch.advantages,
            batch.mask,
            kl_coef=0.0 if reference is None else 0.1,
            logp_ref=logp_ref,
            num_tokens=total,
        )
        terms.loss.backward()
        loss += float(terms.loss.detach())
        mismatch += mismatch_kl(batch.behaviour, logp, batch.mask, total)
    if share:
        scorer.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, mismatch, grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return tiny_model(hidden=32, layers=2, seed=3).float()


@pytest.mark.parametrize(("micro_batch", "temperature"), [(2, 0.6), (4, 1.0)])
def test_shared_prefix_matches_full_passes_on_the_tiny_model(tiny, micro_batch, temperature) -> None:
    samples = _group(258, 60, [9, 23, 0, 14], seed=micro_batch)  # one sample ends where the prefix does
    full = _loss_and_grads(tiny, samples, share=False, micro_batch=micro_batch, temperature=temperature)
    shared = _loss_and_grads(tiny, samples, share=True, micro_batch=micro_batch, temperature=temperature)
    assert abs(full[0]) > 1e-3 and len(full[2]) == len(list(tiny.parameters()))
    assert shared[0] == pytest.approx(full[0], abs=TOL)
    assert shared[1] == pytest.approx(full[1], abs=TOL)
    assert _max_diff(shared[2], full[2]) < TOL


def test_shared_prefix_with_a_reference_model(tiny) -> None:
    reference = tiny_model(hidden=32, layers=2, seed=4).float().requires_grad_(False)
    samples = _group(258, 40, [12, 5, 18], seed=7)
    full = _loss_and_grads(tiny, samples, share=False, micro_batch=2, temperature=0.6, reference=reference)
    shared = _loss_and_grads(tiny, samples, share=True, micro_batch=2, temperature=0.6, reference=reference)
    assert shared[0] == pytest.approx(full[0], abs=TOL)
    assert _max_diff(shared[2], full[2]) < TOL


def test_scorer_logprobs_equal_full_passes_on_real_positions(tiny) -> None:
    samples = _group(258, 30, [4, 11, 7], seed=1)
    seqs = [s.trajectory.token_ids for s in samples]
    with torch.no_grad():
        full, valid = token_logprobs(tiny, seqs, temperature=0.7)
        shared = SequenceScorer(tiny, seqs, temperature=0.7, grad=False)
        assert shared.shared == 32  # 30 prompt tokens and the 2 agreed sampled tokens
        got = shared.logprobs(seqs)
    assert got.shape == full.shape
    assert float(((got - full) * valid).abs().max()) < TOL


def test_scorer_computes_only_the_positions_the_masks_read(tiny) -> None:
    samples = _group(258, 30, [12, 6, 9], seed=2)
    seqs = [s.trajectory.token_ids for s in samples]
    masks = [s.trajectory.loss_mask for s in samples]
    with torch.no_grad():
        full, _ = token_logprobs(tiny, seqs)
        scorer = SequenceScorer(tiny, seqs, grad=False, masks=masks)
        got = scorer.logprobs(seqs, masks)
    read = pack_batch(samples).mask
    assert 0 < read.sum() < read.numel()
    assert float(((got - full) * read).abs().max()) < TOL
    unread = read.sum(dim=0) == 0  # positions no sample of the batch reads are never computed
    assert unread.any() and torch.equal(got[:, unread], torch.zeros_like(got[:, unread]))


@pytest.mark.parametrize("question_lens", [(6, 9, 1), (0, 4, 7)])
def test_a_steps_common_prompt_is_shared_across_groups_exactly(tiny, question_lens) -> None:
    """Three groups: one prompt for all, then each group's own question (0 tokens: the groups'
    prefixes end where the step's does), then per-sample turns. Two-level sharing (the step's prompt
    once, each group's question once on top of it) gives the full passes' loss and gradient."""
    from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients
    from toolgym.training.learn.loss import LossConfig

    rng = random.Random(5)
    prompt = [rng.randrange(258) for _ in range(40)]
    groups = []
    for g, q in enumerate(question_lens):
        question = [rng.randrange(258) for _ in range(q)]
        samples = _group(258, 0, [5 + g, 3, 8], seed=20 + g)
        group = []
        for i, sample in enumerate(samples):
            t = sample.trajectory
            ids, mask = prompt + question + list(t.token_ids), [0] * (40 + q) + list(t.loss_mask)
            group.append(_sample(ids, mask, advantage=sample.advantage, seed=30 + 3 * g + i))
            group[-1] = replace(group[-1], group=g, index=i)
        groups.append(tuple(group))
    plan = StepPlan(advantages=tuple((0.0,) * 3 for _ in groups), groups=tuple(groups), zero_variance=0)
    results = {}
    for share in (False, True):
        tiny.zero_grad(set_to_none=True)
        sums = accumulate_gradients(
            tiny, plan, StepSettings(LossConfig(), micro_batch=2, temperature=0.8, share_prefix=share)
        )
        grads = {n: p.grad.detach().clone() for n, p in tiny.named_parameters() if p.grad is not None}
        results[share] = (sums, grads)
    (off, g_off), (on, g_on) = results[False], results[True]
    assert on.pg == pytest.approx(off.pg, abs=TOL) and on.entropy == pytest.approx(off.entropy, abs=TOL)
    assert on.mismatch_kl == pytest.approx(off.mismatch_kl, abs=TOL)
    assert _max_diff(g_off, g_on) < TOL and max(float(g.abs().max()) for g in g_off.values()) > 1e-4


def test_no_common_prefix_falls_back_to_full_passes(tiny) -> None:
    seqs = [[5, 6, 7, 8], [9, 6, 7]]
    scorer = SequenceScorer(tiny, seqs)
    assert scorer.shared == 0
    with torch.no_grad():
        assert torch.equal(scorer.logprobs(seqs), token_logprobs(tiny, seqs)[0])
    assert SequenceScorer(tiny, [[1, 2, 3]]).shared == 0  # a single sequence has nothing to share
    assert SequenceScorer(tiny, [[1, 2, 3], [1, 2, 4]], share_prefix=False).shared == 0


def test_scoring_a_sequence_outside_the_group_is_an_error(tiny) -> None:
    scorer = SequenceScorer(tiny, [[1, 2, 3, 4], [1, 2, 3, 5]], grad=False)
    with pytest.raises(ValueError, match="shared prefix"):
        scorer.logprobs([[1, 2, 9, 9]])


async def test_trainer_step_is_the_same_with_and_without_prefix_sharing(tmp_path) -> None:
    """One real learner step on a toy-env group: metrics and updated weights agree across the switch."""
    from toolgym.training.config import load_config
    from toolgym.training.sampling.workers import Group

    overrides = [
        "env.id=toy_env:toolgym-test/Letters-v0",
        "policy.kind=tiny",
        "policy.hidden=32",
        "train.group_size=4",
        "train.batching.micro_batch=3",
        "train.optim.lr=0.01",
    ]
    samples = _group(258, 50, [10, 3, 17, 8], seed=11)
    rewarded = tuple(replace(s.trajectory, reward=float(i % 2)) for i, s in enumerate(samples))
    group = Group(index=0, task_id="t", trajectories=rewarded)
    results = []
    for share in (False, True):
        trainer = Trainer(
            load_config(None, [*overrides, f"train.batching.share_prefix={str(share).lower()}"]), tmp_path
        )
        try:
            learn = await trainer._learn([group])
            results.append((learn, [p.detach().clone() for p in trainer.model.parameters()]))
        finally:
            trainer.close()
    (off, weights_off), (on, weights_on) = results
    assert off.tokens == on.tokens > 0 and off.advantages == on.advantages
    assert off.grad_norm > 1e-3 and off.zero_variance == 0
    assert on.grad_norm == pytest.approx(off.grad_norm, abs=TOL)
    for key in ("pg", "clip_frac", "ratio_mean", "mismatch_kl", "entropy"):
        assert getattr(on.losses, key) == pytest.approx(getattr(off.losses, key), abs=TOL), key
    assert max(float((a - b).abs().max()) for a, b in zip(weights_off, weights_on, strict=True)) < TOL


@pytest.mark.model
def test_shared_prefix_matches_full_passes_on_smollm2() -> None:
    """The real model on a real SearchQA prompt's end: three samples whose suffixes differ in text and length.

    The shared part is the prompt's last 120 tokens (the question and the assistant header), which keeps
    the test to seconds; the exactness argument does not depend on the prefix's length.
    """
    from toolgym.agents.harness import get_harness
    from toolgym.agents.policies.hf import HFPolicy
    from toolgym.training.sampling.workers import make_env

    policy = HFPolicy()
    env = make_env("toolgym/SearchQA-v0", {"max_turns": 2})
    try:
        obs, _ = env.reset(seed=0, options={"tools": ["answer", "search"]})
        prompt = policy.render(get_harness("bare").start(obs, max_turns=2))[-120:]
        call = '<tool_call>{"name": "'
        turns = [  # all three agree on their first sampled tokens, so the shared part ends inside them
            [
                (call + 'search", "arguments": {"query": "Panthers defense"}}</tool_call>', 1),
                ("doc 7: 308", 0),
            ],
            [(call + 'search", "arguments": {"query": "points"}}</tool_call>', 1), ("doc 2", 0), ("ok", 1)],
            [(call + 'answer", "arguments": {"answer": "24 points"}}</tool_call>', 1)],
        ]
        samples = []
        for i, parts in enumerate(turns):
            ids, mask = list(prompt), [0] * len(prompt)
            for text, m in parts:
                encoded = policy.tokenizer.encode(text)
                ids += encoded
                mask += [m] * len(encoded)
            samples.append(_sample(ids, mask, advantage=(1.0, -0.5, -0.5)[i], seed=i))
        assert (
            SequenceScorer(policy.model, [s.trajectory.token_ids for s in samples], grad=False).shared > 120
        )
        full = _loss_and_grads(policy.model, samples, share=False, micro_batch=2, temperature=0.6)
        shared = _loss_and_grads(policy.model, samples, share=True, micro_batch=2, temperature=0.6)
    finally:
        env.close()
        policy.close()
    assert abs(full[0]) > 1e-3
    assert shared[0] == pytest.approx(full[0], abs=TOL)
    assert shared[1] == pytest.approx(full[1], abs=TOL)
    # 135M float32 gradients summed in another order: relative to the largest gradient, not absolute
    # (measured: 1.96e-5 absolute with transformers 5.19 / torch 2.13). A wrong prefix pass is off by
    # the gradient's own size.
    largest = max(float(g.abs().max()) for g in full[2].values())
    assert _max_diff(shared[2], full[2]) < 1e-4 * largest


@pytest.mark.parametrize("share", [False, True])
def test_a_token_budget_per_micro_batch_gives_the_count_s_loss_and_gradient(tiny, share) -> None:
    """Micro-batches by a token budget (longest first, several short ones to a pass) change only the
    order of float sums: the loss terms and the gradient equal those of micro-batches by count."""
    from toolgym.training.learn.grpo import StepPlan, StepSettings, accumulate_gradients
    from toolgym.training.learn.loss import LossConfig

    groups = tuple(
        tuple(replace(s, group=g, index=i) for i, s in enumerate(_group(258, 30, lens, seed=40 + g)))
        for g, lens in enumerate([(3, 40, 7, 22), (15, 2, 31, 9)])
    )
    plan = StepPlan(advantages=tuple((0.0,) * 4 for _ in groups), groups=groups, zero_variance=0)
    results = []
    for budget in (0, 80):
        tiny.zero_grad(set_to_none=True)
        sums = accumulate_gradients(
            tiny,
            plan,
            StepSettings(
                LossConfig(), micro_batch=2, micro_batch_tokens=budget, temperature=0.9, share_prefix=share
            ),
        )
        grads = {n: p.grad.detach().clone() for n, p in tiny.named_parameters() if p.grad is not None}
        results.append((sums, grads))
    (count, g_count), (budget, g_budget) = results
    assert budget.pg == pytest.approx(count.pg, abs=TOL) and budget.entropy == pytest.approx(
        count.entropy, abs=TOL
    )
    assert budget.mismatch_kl == pytest.approx(count.mismatch_kl, abs=TOL)
    assert _max_diff(g_count, g_budget) < TOL and max(float(g.abs().max()) for g in g_count.values()) > 1e-4
