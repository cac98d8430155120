"""``[train]``: the learner and the rollout pipeline (:class:`GRPOConfig`), torch-free.

Its loss variant, learning-rate schedule and LoRA settings are checked where each is defined
(:class:`~toolgym.training.learn.objective.LossConfig`, :class:`~toolgym.training.learn.optim.ScheduleConfig`,
:class:`~toolgym.training.learn.lora.LoraSettings`), so every wrong value fails at start-up with its own
message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from toolgym.errors import ConfigError, did_you_mean
from toolgym.records.trackers import parse_trackers
from toolgym.training.learn.lora import LoraSettings
from toolgym.training.learn.objective import LossConfig
from toolgym.training.learn.optim import ScheduleConfig

__all__ = ["LEARNER_NODES", "TASK_FILTERS", "TASK_POOLS", "GRPOConfig"]

#: Train-split task selection (``train.task_filter``, while training; ``train.task_pool``, before).
TASK_FILTERS = ("none", "pass_rate")
TASK_POOLS = ("all", "reference")
#: Where learner actors may run with the Ray backend (``train.learner_nodes``).
LEARNER_NODES = ("trainer", "any")


@dataclass(frozen=True)
class GRPOConfig:
    """The learner and the rollout pipeline.

    Attributes:
        steps: optimizer steps to run.
        tasks_per_step: groups per step (distinct tasks); with ``dynamic_sampling``, the informative
            groups a step wants at least.
        group_size: samples per task (G); advantages are relative within a group.
        lr, weight_decay, max_grad_norm, betas: AdamW and gradient clipping.
        clip_low, clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``.
        kl_coef: weight of the k3 KL to the initial model (0 = no reference model is kept).
        normalize_std: divide advantages by the group's std (GRPO) or only centre them.
        skip_zero_variance: leave groups whose rewards are all equal out of the loss (no signal).
        max_off_policy_steps: how many steps rollouts run ahead of the learner (0 = synchronous:
            every group is sampled by the weights it trains); a group older than this is dropped.
        rollout_workers: groups sampled concurrently (a wave of groups runs at once when there are
            as many workers; a vLLM engine batches every episode in flight).
        micro_batch: sequences per forward/backward pass in the learner.
        share_prefix: compute the prompt every group of the step starts with once, each group's
            common prefix once on top of it, and score only each sample's suffix against them (same
            logprobs and gradient up to float rounding, several times less compute); ``false`` runs
            every sequence in full (the control the learner bench uses).
        checkpoint_every: steps between checkpoints (0 = only at the end).
        seed: seeds task order, sampling, the model init (``tiny``) and the curriculum.
        format_credit: optional shaped credit added to the verifier's reward for the learner only
            (see :func:`toolgym.training.trainer.shaped_reward`); 0 trains on the verifier's reward alone.
        answer_tool: name of the environment's terminal tool, for ``format_credit``.
        backend: where environments run: ``asyncio`` (in-process, the default) or ``ray`` (Ray actors,
            see :mod:`toolgym.training.sampling.ray_envs`; the rollout loop and the policy stay in-process).
        ray_env_actors: environment actor processes for ``backend = "ray"``.
        learners: learner processes sharing each step's gradient over ``torch.distributed`` (data
            parallel; :mod:`toolgym.training.distributed.learners`): rank 0 samples, checkpoints and publishes, the
            others only compute gradients. At most ``tasks_per_step``; under ``torchrun`` its world
            size decides.
        dist_backend: the learners' process group: ``gloo`` (CPU) or ``nccl`` (CUDA learners).
        shard: how several learners hold the model: ``none`` (each a whole copy, gradients summed) or
            ``fsdp2`` (parameters, gradients and optimizer state split across them with FSDP2's
            ``fully_shard``; :mod:`toolgym.training.distributed.fsdp`). Needs two or more learners; not with LoRA.
        learner_timeout: seconds a learner collective may wait before the run stops.
        learner_nodes: with ``backend = "ray"``, where the learner actors (ranks 1..N-1) run:
            ``trainer`` (the trainer's own Ray node; the ranks meet on 127.0.0.1) or ``any`` (wherever
            in the Ray cluster their resources are free; the ranks meet at the trainer node's address).
            See :mod:`toolgym.training.distributed.ray_actors`.
        learner_resources: with ``learner_nodes = "any"``, the Ray resources each learner actor asks
            for besides its GPU on CUDA (e.g. ``{learner_slot = 1}``, a custom resource that the nodes
            meant for learners were started with; ``CPU`` and ``GPU`` count as ``num_cpus`` and
            ``num_gpus``). A cluster without them in all is refused at start.
        max_infra_groups: consecutive groups whose every sample is ``infra_error`` (retries included)
            after which the run stops with a message (the infrastructure is down); it resumes from its
            last checkpoint.
        max_nonfinite_steps: consecutive steps skipped because a trained logprob, the loss or the
            gradient norm was NaN or infinite (:mod:`toolgym.training.learn.step_guard`: a skipped step
            leaves every weight untouched) after which the run stops; it resumes from its last
            checkpoint.
        loggers: experiment trackers that also receive the metrics, config and trajectories:
            ``tensorboard``, ``wandb`` (offline); see :mod:`toolgym.records.trackers`. Empty: files only.
        loss_agg: how a step's per-token terms become its loss: ``token_mean`` (DAPO), ``seq_mean``
            (GRPO: each sequence's mean, averaged) or ``constant`` (Dr. GRPO: sums divided by
            ``loss_constant`` and the number of sequences).
        loss_constant: the constant normaliser of ``loss_agg = "constant"``, in tokens.
        ratio: ``token`` (each token's importance ratio) or ``sequence`` (GSPO: one ratio per sequence,
            the exp of its mean log-ratio, clipped as a whole).
        dual_clip: cap the loss of negative-advantage tokens at ``dual_clip * |A|`` (> 1; 0 = off).
        tis_cap: truncated importance sampling of the sampler/learner mismatch, weights capped at this
            (> 1; 0 = off); the clip is then taken against the learner's own logprobs.
        lr_schedule: ``constant``, ``linear`` or ``cosine`` (to ``min_lr_ratio * lr`` at the last step).
        warmup_steps: optimizer steps of linear learning-rate warm-up (0 = none).
        min_lr_ratio: where ``linear`` and ``cosine`` end, as a share of ``lr``.
        lora_rank: LoRA adapters of this rank instead of full fine-tuning (0 = full; needs ``peft``,
            extra ``toolgym[lora]``); exports and vLLM syncs carry merged weights.
        lora_alpha: LoRA's scale numerator (the adapter is scaled by ``lora_alpha / lora_rank``).
        lora_targets: the Linear layers that get adapters (by name).
        lora_dropout: dropout on the adapters' input (0 keeps sampling and scoring identical).
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
    """

    steps: int = 20
    tasks_per_step: int = 2
    group_size: int = 4
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    normalize_std: bool = True
    skip_zero_variance: bool = True
    max_off_policy_steps: int = 1
    rollout_workers: int = 2
    micro_batch: int = 4
    share_prefix: bool = True
    checkpoint_every: int = 1
    seed: int = 0
    format_credit: float = 0.0
    answer_tool: str = "answer"
    backend: str = "asyncio"
    ray_env_actors: int = 2
    learners: int = 1
    dist_backend: str = "gloo"
    shard: str = "none"
    learner_timeout: float = 1800.0
    learner_nodes: str = "trainer"
    learner_resources: Mapping[str, float] = field(default_factory=dict)
    max_infra_groups: int = 4
    max_nonfinite_steps: int = 3
    loggers: tuple[str, ...] = ()
    loss_agg: str = "token_mean"
    loss_constant: int = 256
    ratio: str = "token"
    dual_clip: float = 0.0
    tis_cap: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LoraSettings().targets
    lora_dropout: float = 0.0
    dynamic_sampling: bool = False
    max_groups_per_step: int = 0
    task_filter: str = "none"
    task_pool: str = "all"
    task_pool_min_reward: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "loggers", parse_trackers(self.loggers))
        for name in (
            "steps",
            "tasks_per_step",
            "group_size",
            "rollout_workers",
            "micro_batch",
            "max_infra_groups",
            "max_nonfinite_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError(
                "train.group_size must be >= 2: group-relative advantages need at least two samples"
            )
        if self.backend not in ("asyncio", "ray"):
            raise ConfigError(
                f"train.backend must be 'asyncio' or 'ray', got {self.backend!r}."
                f"{did_you_mean(self.backend, ['asyncio', 'ray'])}"
            )
        if self.ray_env_actors < 1:
            raise ConfigError(f"train.ray_env_actors must be >= 1, got {self.ray_env_actors}")
        self._check_learners()
        if self.max_off_policy_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("train.max_off_policy_steps and train.checkpoint_every must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"train.lr must be >= 0 (0: the control run, no update), got {self.lr}")
        self.loss_config()  # each is checked where it is defined, with its own message
        self.schedule_config()
        self.lora_settings()
        if self.max_groups_per_step < 0:
            raise ConfigError(
                f"train.max_groups_per_step must be >= 0 (0 = automatic), got {self.max_groups_per_step}"
            )
        if self.dynamic_sampling and 0 < self.max_groups_per_step < self.tasks_per_step:
            raise ConfigError(
                f"train.max_groups_per_step ({self.max_groups_per_step}) is below train.tasks_per_step "
                f"({self.tasks_per_step}): a step could never fill; raise it or set 0 (automatic)"
            )
        if self.task_pool not in TASK_POOLS:
            raise ConfigError(
                f"train.task_pool must be one of {', '.join(TASK_POOLS)}, got {self.task_pool!r}."
                f"{did_you_mean(self.task_pool, TASK_POOLS)}"
            )
        if self.task_filter not in TASK_FILTERS:
            raise ConfigError(
                f"train.task_filter must be one of {', '.join(TASK_FILTERS)}, got {self.task_filter!r}."
                f"{did_you_mean(self.task_filter, TASK_FILTERS)}"
            )

    def _check_learners(self) -> None:
        if self.learners < 1:
            raise ConfigError(f"train.learners must be >= 1, got {self.learners}")
        self.check_learner_count(self.learners, f"train.learners ({self.learners})", "train.learners > 1")
        if self.dist_backend not in ("gloo", "nccl"):
            raise ConfigError(
                f"train.dist_backend must be 'gloo' or 'nccl', got {self.dist_backend!r}."
                f"{did_you_mean(self.dist_backend, ['gloo', 'nccl'])}"
            )
        if self.shard not in ("none", "fsdp2"):
            raise ConfigError(
                f"train.shard must be 'none' or 'fsdp2', got {self.shard!r}."
                f"{did_you_mean(self.shard, ['none', 'fsdp2'])}"
            )
        if self.shard == "fsdp2" and self.lora_rank > 0:
            raise ConfigError(
                "train.shard = 'fsdp2' with LoRA (train.lora_rank > 0): not supported; LoRA's optimizer "
                "state is small, use train.shard = 'none'"
            )
        if self.learner_timeout <= 0:
            raise ConfigError(f"train.learner_timeout must be > 0 seconds, got {self.learner_timeout}")
        self._check_learner_placement()

    def _check_learner_placement(self) -> None:
        if self.learner_nodes not in LEARNER_NODES:
            raise ConfigError(
                f"train.learner_nodes must be one of {', '.join(LEARNER_NODES)}, got {self.learner_nodes!r}."
                f"{did_you_mean(self.learner_nodes, LEARNER_NODES)}"
            )
        for name, amount in self.learner_resources.items():
            if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
                raise ConfigError(
                    f"train.learner_resources.{name} must be a number > 0 (how much of Ray resource "
                    f"{name!r} each learner actor asks for), got {amount!r}"
                )
        if self.learner_resources and self.learner_nodes != "any":
            raise ConfigError(
                "train.learner_resources places the learner actors by Ray resources, anywhere in the "
                "cluster: set train.learner_nodes = 'any' too (the default, 'trainer', keeps them on "
                "the trainer's node)"
            )
        if self.learner_nodes != "trainer" and self.backend != "ray":
            raise ConfigError(
                f"train.learner_nodes = {self.learner_nodes!r} places learners on Ray nodes: it needs "
                "train.backend = 'ray' (with the default backend the learners are child processes "
                "of the trainer; across machines, start the ranks with torchrun instead)"
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
        if world > 1 and self.kl_coef > 0:
            raise ConfigError(
                f"train.kl_coef > 0 with {several}: the KL's reference model is not kept on the other "
                "learners yet; use one learner, or kl_coef = 0"
            )

    def loss_config(self) -> LossConfig:
        """The step's surrogate (:class:`~toolgym.training.learn.loss.LossConfig`)."""
        return LossConfig(
            agg=self.loss_agg,
            constant_norm=self.loss_constant,
            ratio=self.ratio,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
            kl_coef=self.kl_coef,
        )

    def schedule_config(self) -> ScheduleConfig:
        """The learning-rate schedule over ``steps`` optimizer steps."""
        return ScheduleConfig(
            name=self.lr_schedule,
            warmup_steps=self.warmup_steps,
            total_steps=self.steps,
            min_lr_ratio=self.min_lr_ratio,
        )

    def lora_settings(self) -> LoraSettings:
        return LoraSettings(
            rank=self.lora_rank, alpha=self.lora_alpha, targets=self.lora_targets, dropout=self.lora_dropout
        )

    @property
    def group_budget(self) -> int:
        """Groups one step may draw: ``tasks_per_step`` without dynamic sampling."""
        if not self.dynamic_sampling:
            return self.tasks_per_step
        return self.max_groups_per_step or 3 * self.tasks_per_step
