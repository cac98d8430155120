"""``[train]``: the learner and the rollout pipeline, with one sub-table per thing the code handles apart.

=====================  ==========================================================================
table                  what it sets (its consumer)
=====================  ==========================================================================
``[train]``            the run's shape: steps, groups, seeds, rewards, task selection, stops
``[train.loss]``       the policy-gradient surrogate (:mod:`toolgym.training.learn.loss`)
``[train.optim]``      AdamW, clipping and the learning-rate schedule (:mod:`toolgym.training.learn.optim`)
``[train.lora]``       LoRA adapters instead of full fine-tuning (:mod:`toolgym.training.learn.lora`)
``[train.batching]``   how a step's sequences go through the model (:mod:`toolgym.training.learn.grpo`)
``[train.rollouts]``   rollout workers, staleness, the environment backend (:mod:`toolgym.training.sampling`)
``[train.learners]``   several learner processes (:mod:`toolgym.training.distributed`)
=====================  ==========================================================================

Data only: every table checks its own values when built (a wrong value fails at start-up with its own
message, naming its key), and this module imports no runtime code, so each runtime module takes the
table it needs, typed. The flat keys of earlier releases (``train.lr``, ``train.lora_rank``) still load,
with a warning naming the new key (:data:`toolgym.training.config.load.RENAMED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from toolgym.errors import ConfigError, check_choice
from toolgym.records.trackers import parse_trackers

__all__ = [
    "AGGREGATIONS",
    "DIST_BACKENDS",
    "ENV_BACKENDS",
    "LEARNER_NODES",
    "RATIOS",
    "SCHEDULES",
    "SHARDS",
    "TASK_FILTERS",
    "REWARD_CONTROLS",
    "TASK_POOLS",
    "BatchingConfig",
    "LearnersConfig",
    "LoraConfig",
    "LossConfig",
    "OptimConfig",
    "RolloutsConfig",
    "TrainConfig",
]

#: ``train.loss.agg``: how the per-token terms of a step are summed into one loss.
AGGREGATIONS = ("token_mean", "seq_mean", "constant")
#: ``train.loss.ratio``: where the importance ratio lives, per token (PPO/GRPO) or per sequence (GSPO).
RATIOS = ("token", "sequence")
#: ``train.optim.schedule``.
SCHEDULES = ("constant", "linear", "cosine")
#: ``train.rollouts.backend``: where environments run.
ENV_BACKENDS = ("asyncio", "ray")
#: ``train.learners.backend``: the learners' process group.
DIST_BACKENDS = ("gloo", "nccl")
#: ``train.learners.shard``: how several learners hold the model.
SHARDS = ("none", "fsdp2")
#: ``train.learners.nodes``: where learner actors may run with the Ray backend.
LEARNER_NODES = ("trainer", "any")
#: Train-split task selection (``train.task_filter``, while training; ``train.task_pool``, before).
TASK_FILTERS = ("none", "pass_rate")
TASK_POOLS = ("all", "reference")
#: What the training rewards are scored against (``train.reward_control``).
REWARD_CONTROLS = ("none", "shuffled")


def _at_least(table: object, prefix: str, minimum: int, *names: str) -> None:
    for name in names:
        if getattr(table, name) < minimum:
            raise ConfigError(f"{prefix}.{name} must be >= {minimum}, got {getattr(table, name)}")


@dataclass(frozen=True)
class LossConfig:
    """``[train.loss]``: the policy-gradient surrogate of one step (each variant has exact-value tests).

    Attributes:
        agg: how the per-token terms become one number. ``token_mean``: summed over every mask-1 token
            of the step and divided by their count (DAPO; long answers weigh more). ``seq_mean``: each
            sequence's mean, averaged over the step's sequences (the original GRPO). ``constant``:
            summed per sequence and divided by ``constant_norm`` and the number of sequences (Dr. GRPO:
            no length bias either way).
        constant_norm: the constant normaliser of ``agg = "constant"`` (tokens; e.g. the most a
            sequence can sample).
        ratio: ``token``: each token's own importance ratio; ``sequence``: one ratio per sequence, the
            exp of the mean log-ratio of its tokens, clipped as a whole (GSPO; pair it with small
            clip ranges, e.g. 3e-4 / 4e-4, and ``agg = "seq_mean"`` for the paper's objective).
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: for negative advantages, cap the per-token loss at ``dual_clip * |A|`` (> 1; 0 =
            off), so that a token whose ratio exploded cannot dominate the step.
        tis_cap: truncated importance sampling (> 1; 0 = off). The surrogate's ratio is taken against
            the learner's own (detached) logprobs, and each token is weighted by
            ``min(exp(logp_learner - logp_sampler), tis_cap)``: the sampler (vLLM, another dtype,
            another kernel) and the learner disagree a little on every token, and this corrects the
            gradient for it without letting a rare token's weight explode. With one update per batch
            the learner's logprobs are those of the weights that sampled (at look-ahead 0), so the
            clip never binds and the cap is the trust region.
        kl_coef: weight of the k3 KL to the initial model (0 = no reference model is kept).
    """

    agg: str = "token_mean"
    constant_norm: int = 256
    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0
    tis_cap: float = 0.0
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check_choice("train.loss.agg", self.agg, AGGREGATIONS)
        check_choice("train.loss.ratio", self.ratio, RATIOS)
        if self.constant_norm < 1:
            raise ConfigError(f"train.loss.constant_norm must be >= 1 token, got {self.constant_norm}")
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ConfigError(
                "train.loss.clip_low must lie in [0, 1) and train.loss.clip_high be >= 0, got "
                f"{self.clip_low}, {self.clip_high}"
            )
        if self.dual_clip != 0.0 and not self.dual_clip > 1.0:
            raise ConfigError(
                "train.loss.dual_clip must be > 1 (a cap of c * |A| on negative-advantage tokens) or 0 to "
                f"turn it off, got {self.dual_clip}"
            )
        if self.tis_cap != 0.0 and not self.tis_cap > 1.0:
            raise ConfigError(
                "train.loss.tis_cap must be > 1 (importance weights are truncated at it) or 0 to turn it "
                f"off, got {self.tis_cap}: a cap <= 1 would down-weight every token the learner likes "
                "better than the sampler did"
            )
        if self.kl_coef < 0:
            raise ConfigError(f"train.loss.kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class OptimConfig:
    """``[train.optim]``: AdamW on fp32 master weights, gradient clipping, the learning-rate schedule.

    Attributes:
        lr: the learning rate (0: the control run, no update).
        weight_decay, betas: AdamW's.
        max_grad_norm: the gradient norm is clipped to this before each step.
        schedule: ``constant``, ``linear`` or ``cosine`` (to ``min_lr_ratio * lr`` at the last step).
        warmup_steps: optimizer steps of linear learning-rate warm-up (0 = none).
        min_lr_ratio: where ``linear`` and ``cosine`` end, as a share of ``lr``.
    """

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    max_grad_norm: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ConfigError(f"train.optim.lr must be >= 0 (0: the control run, no update), got {self.lr}")
        check_choice("train.optim.schedule", self.schedule, SCHEDULES)
        if self.warmup_steps < 0:
            raise ConfigError(f"train.optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm <= 0:
            raise ConfigError(f"train.optim.max_grad_norm must be > 0, got {self.max_grad_norm}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.optim.betas must be two numbers in [0, 1), got {self.betas!r}")


@dataclass(frozen=True)
class LoraConfig:
    """``[train.lora]``: LoRA adapters instead of full fine-tuning (needs ``peft``, extra ``toolgym[lora]``).

    Attributes:
        rank: the adapters' rank (0 = full fine-tuning); exports and vLLM syncs carry merged weights.
        alpha: LoRA's scale numerator (the adapter is scaled by ``alpha / rank``).
        targets: the Linear layers that get adapters (by name).
        dropout: dropout on the adapters' input (0 keeps sampling and scoring identical).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"train.lora.rank must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if self.rank and not self.targets:
            raise ConfigError("train.lora.targets must name at least one Linear layer (e.g. q_proj)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"train.lora.dropout must lie in [0, 1), got {self.dropout}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class BatchingConfig:
    """``[train.batching]``: how a step's sequences go through the learner's model.

    Attributes:
        micro_batch: sequences per forward/backward pass in the learner.
        micro_batch_tokens: a token budget per forward/backward pass as well (0 = the count alone):
            the unit's sequences go longest first, and a micro-batch closes before its padded tokens
            (rows times the longest row, counted after the shared prefix) would pass this, so short
            sequences travel many to a pass and long ones few, with less padding. The loss and the
            gradient are the same up to float rounding (every token is weighed for the whole step).
            At least every environment's ``max_total_tokens``, so that any one sequence fits.
        share_prefix: compute the prompt every group of the step starts with once, each group's
            common prefix once on top of it, and score only each sample's suffix against them (same
            logprobs and gradient up to float rounding, several times less compute); ``false`` runs
            every sequence in full (the control the learner bench uses).
        checkpoint_layers: activation checkpointing: each decoder layer keeps only its input for the
            backward pass and runs its forward again there (same values and gradient up to float
            rounding; activations several times smaller, one more forward pass of compute); the
            shared prefixes' passes are not checkpointed. Not with ``train.learners.shard = "fsdp2"``.
    """

    micro_batch: int = 4
    micro_batch_tokens: int = 0
    share_prefix: bool = True
    checkpoint_layers: bool = False

    def __post_init__(self) -> None:
        _at_least(self, "train.batching", 1, "micro_batch")
        _at_least(self, "train.batching", 0, "micro_batch_tokens")


@dataclass(frozen=True)
class RolloutsConfig:
    """``[train.rollouts]``: the rollout pipeline.

    Attributes:
        workers: groups sampled concurrently (a wave of groups runs at once when there are as many
            workers; a vLLM engine batches every episode in flight).
        max_off_policy_steps: how many steps rollouts run ahead of the learner (0 = synchronous:
            every group is sampled by the weights it trains); a group older than this is dropped.
        backend: where environments run: ``asyncio`` (in-process, the default) or ``ray`` (Ray actors,
            see :mod:`toolgym.training.sampling.ray_envs`; the rollout loop and the policy stay
            in-process).
        ray_env_actors: environment actor processes for ``backend = "ray"``.
    """

    workers: int = 2
    max_off_policy_steps: int = 1
    backend: str = "asyncio"
    ray_env_actors: int = 2

    def __post_init__(self) -> None:
        _at_least(self, "train.rollouts", 1, "workers", "ray_env_actors")
        _at_least(self, "train.rollouts", 0, "max_off_policy_steps")
        check_choice("train.rollouts.backend", self.backend, ENV_BACKENDS)


@dataclass(frozen=True)
class LearnersConfig:
    """``[train.learners]``: several learner processes sharing each step's gradient (data parallel).

    Attributes:
        count: learner processes over ``torch.distributed`` (:mod:`toolgym.training.distributed`):
            rank 0 samples, checkpoints and publishes, the others only compute gradients. At most
            ``train.tasks_per_step``; under ``torchrun`` its world size decides.
        backend: the learners' process group: ``gloo`` (CPU) or ``nccl`` (CUDA learners).
        shard: how several learners hold the model: ``none`` (each a whole copy, gradients summed) or
            ``fsdp2`` (parameters, gradients and optimizer state split across them with FSDP2's
            ``fully_shard``). Needs two or more learners; not with LoRA.
        timeout: seconds a learner collective may wait before the run stops.
        nodes: with ``train.rollouts.backend = "ray"``, where the learner actors (ranks 1..N-1) run:
            ``trainer`` (the trainer's own Ray node; the ranks meet on 127.0.0.1) or ``any`` (wherever
            in the Ray cluster their resources are free; the ranks meet at the trainer node's address).
        resources: with ``nodes = "any"``, the Ray resources each learner actor asks for besides its GPU
            on CUDA (e.g. ``{learner_slot = 1}``, a custom resource that the nodes meant for learners
            were started with; ``CPU`` and ``GPU`` count as ``num_cpus`` and ``num_gpus``). A cluster
            without them in all is refused at start.
    """

    count: int = 1
    backend: str = "gloo"
    shard: str = "none"
    timeout: float = 1800.0
    nodes: str = "trainer"
    resources: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _at_least(self, "train.learners", 1, "count")
        check_choice("train.learners.backend", self.backend, DIST_BACKENDS)
        check_choice("train.learners.shard", self.shard, SHARDS)
        check_choice("train.learners.nodes", self.nodes, LEARNER_NODES)
        if self.timeout <= 0:
            raise ConfigError(f"train.learners.timeout must be > 0 seconds, got {self.timeout}")
        for name, amount in self.resources.items():
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
                raise ConfigError(
                    f"train.learners.resources.{name} must be a number > 0 (how much of Ray resource "
                    f"{name!r} each learner actor asks for), got {amount!r}"
                )
        if self.resources and self.nodes != "any":
            raise ConfigError(
                "train.learners.resources places the learner actors by Ray resources, anywhere in the "
                "cluster: set train.learners.nodes = 'any' too (the default, 'trainer', keeps them on "
                "the trainer's node)"
            )


@dataclass(frozen=True)
class TrainConfig:
    """``[train]``: the run's shape (its sub-tables: the module docstring).

    Attributes:
        steps: optimizer steps to run.
        tasks_per_step: groups per step (distinct tasks); with ``dynamic_sampling``, the informative
            groups a step wants at least.
        group_size: samples per task (G); advantages are relative within a group.
        seed: seeds task order, sampling, the model init (``tiny``) and the curriculum.
        checkpoint_every: steps between checkpoints (0 = only at the end).
        normalize_std: divide advantages by the group's std (GRPO) or only centre them.
        skip_zero_variance: leave groups whose rewards are all equal out of the loss (no signal).
        format_credit: optional shaped credit added to the verifier's reward for the learner only
            (see :func:`toolgym.training.learn.rewards.shaped_reward`); 0 trains on the verifier's
            reward alone.
        answer_tool: name of the environment's terminal tool, for ``format_credit``.
        dynamic_sampling: drop groups without reward variance (they carry no gradient) and draw more
            until the step has ``tasks_per_step`` informative groups or has drawn
            ``max_groups_per_step``; dropped groups are logged (``trained: false``) and counted.
        max_groups_per_step: the most groups one step may draw with ``dynamic_sampling`` (0 = three
            times ``tasks_per_step``). Groups are drawn in waves sized by the run's informative share
            so far, and every informative group of a wave trains (a step may train more than
            ``tasks_per_step``). A step that finds no informative group within it takes no optimizer
            step, says so, and the run goes on.
        task_filter: ``none``, or ``pass_rate``: a task whose last group had no reward variance on the
            train split (solved by every sample, or by none) is skipped the next time the epoch order
            reaches it (then tried again); only training groups feed it.
        task_pool: ``all`` training tasks, or ``reference``: only those the environment's
            ``reference_rule`` solves at ``task_pool_min_reward`` (decided once, model-free, before
            training; the warm start still draws from all of them).
        task_pool_min_reward: the reward a reference demonstration must reach for its task to stay.
        reward_control: ``none``, or ``shuffled``: a control arm whose training episodes are each
            scored against another training task's reference (a seeded permutation of the training
            tasks with no task left in place, :mod:`toolgym.training.sampling.reward_control`), so its
            rewards carry no information about the task; held-out evaluations are never shuffled.
            One environment of two or more training tasks.
        max_infra_groups: consecutive groups whose every sample is ``infra_error`` (retries included)
            after which the run stops with a message (the infrastructure is down); it resumes from its
            last checkpoint.
        max_nonfinite_steps: consecutive steps skipped because a trained logprob, the loss or the
            gradient norm was NaN or infinite (:mod:`toolgym.training.learn.step_guard`: a skipped
            step leaves every weight untouched) after which the run stops; it resumes from its last
            checkpoint.
        loggers: experiment trackers that also receive the metrics, config and trajectories:
            ``tensorboard``, ``wandb`` (offline); see :mod:`toolgym.records.trackers`. Empty: files only.
        loss: ``[train.loss]``, the surrogate.
        optim: ``[train.optim]``, the optimizer and its schedule.
        lora: ``[train.lora]``, adapters instead of full fine-tuning.
        batching: ``[train.batching]``, micro-batches and prefix sharing.
        rollouts: ``[train.rollouts]``, the rollout pipeline.
        learners: ``[train.learners]``, several learner processes.
    """

    steps: int = 20
    tasks_per_step: int = 2
    group_size: int = 4
    seed: int = 0
    checkpoint_every: int = 1
    normalize_std: bool = True
    skip_zero_variance: bool = True
    format_credit: float = 0.0
    answer_tool: str = "answer"
    dynamic_sampling: bool = False
    max_groups_per_step: int = 0
    task_filter: str = "none"
    task_pool: str = "all"
    task_pool_min_reward: float = 0.5
    reward_control: str = "none"
    max_infra_groups: int = 4
    max_nonfinite_steps: int = 3
    loggers: tuple[str, ...] = ()
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    learners: LearnersConfig = field(default_factory=LearnersConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loggers", parse_trackers(self.loggers))
        _at_least(self, "train", 1, "steps", "tasks_per_step", "max_infra_groups", "max_nonfinite_steps")
        _at_least(self, "train", 0, "checkpoint_every", "max_groups_per_step")
        if self.group_size < 2:
            raise ConfigError(
                "train.group_size must be >= 2: group-relative advantages need at least two samples"
            )
        check_choice("train.task_pool", self.task_pool, TASK_POOLS)
        check_choice("train.reward_control", self.reward_control, REWARD_CONTROLS)
        check_choice("train.task_filter", self.task_filter, TASK_FILTERS)
        if self.dynamic_sampling and 0 < self.max_groups_per_step < self.tasks_per_step:
            raise ConfigError(
                f"train.max_groups_per_step ({self.max_groups_per_step}) is below train.tasks_per_step "
                f"({self.tasks_per_step}): a step could never fill; raise it or set 0 (automatic)"
            )
        self.check_learner_count(
            self.learners.count, f"train.learners.count ({self.learners.count})", "train.learners.count > 1"
        )
        if self.learners.shard == "fsdp2" and self.lora.enabled:
            raise ConfigError(
                "train.learners.shard = 'fsdp2' with LoRA (train.lora.rank > 0): not supported; LoRA's "
                "optimizer state is small, use train.learners.shard = 'none'"
            )
        if self.learners.shard == "fsdp2" and self.batching.checkpoint_layers:
            raise ConfigError(
                "train.batching.checkpoint_layers with train.learners.shard = 'fsdp2': not supported (the "
                "sharded learner gathers each layer's weights in its own hooks); use "
                "train.learners.shard = 'none', or leave checkpoint_layers off"
            )
        if self.learners.nodes != "trainer" and self.rollouts.backend != "ray":
            raise ConfigError(
                f"train.learners.nodes = {self.learners.nodes!r} places learners on Ray nodes: it needs "
                "train.rollouts.backend = 'ray' (with the default backend the learners are child "
                "processes of the trainer; across machines, start the ranks with torchrun instead)"
            )

    def check_learner_count(self, world: int, named: str, several: str) -> None:
        """Refuse ``world`` learner processes (``named``/``several`` say where the number came from: the
        config, or torchrun's world size) that this config cannot use: more than its groups per step,
        or several with a KL reference model."""
        if world > self.tasks_per_step:
            raise ConfigError(
                f"{named} is more than train.tasks_per_step ({self.tasks_per_step}): a learner would never "
                "get a group; use at most as many learners as groups per step"
            )
        if world > 1 and self.loss.kl_coef > 0:
            raise ConfigError(
                f"train.loss.kl_coef > 0 with {several}: the KL's reference model is not kept on the other "
                "learners yet; use one learner, or kl_coef = 0"
            )

    @property
    def group_budget(self) -> int:
        """Groups one step may draw: ``tasks_per_step`` without dynamic sampling."""
        if not self.dynamic_sampling:
            return self.tasks_per_step
        return self.max_groups_per_step or 3 * self.tasks_per_step
