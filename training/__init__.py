"""toolgym.training: RL training of tool-using policies, in five ideas and the loop that joins them.

* :mod:`~toolgym.training.learn` — the learner step as pure pieces: rewards and advantages, the step's
  plan (:mod:`~toolgym.training.learn.grpo`), the surrogate loss, packing sequences into batches,
  scoring them with shared prefixes, the optimizer, LoRA, and the guard against non-finite steps.
* :mod:`~toolgym.training.sampling` — what a step trains on: rollout workers (one environment pool per
  environment, groups admitted by the learner), the step's collection (waves, stale and zero-variance
  drops), environments on Ray actors, mixtures of environments, task filters and the tool curriculum.
* :mod:`~toolgym.training.distributed` — several learner processes sharing a step: the group (rank
  0's side), what every rank runs, ranks 1..N-1, Ray actors, FSDP2 shards, and how ranks meet.
* :mod:`~toolgym.training.heldout` — the held-out evaluation: its table, the run at the end of
  training, and the curve during it.
* :mod:`~toolgym.training.experiments` — runs compared: experiment arms, their paired results and
  reports, studies kept as result files, the run report and its statistics.

At the top: :mod:`~toolgym.training.trainer` (the loop), :mod:`~toolgym.training.commands`
(``toolgym train``/``report``), the config (:mod:`~toolgym.training.config`: the TOML file's tables as frozen dataclasses), the trained
policy (:mod:`~toolgym.training.policy_build` builds it, :mod:`~toolgym.training.policy_handle` publishes its weights), checkpoints, exports, the weight sync, the warm start,
the step log and progress, and the run's result file (:mod:`~toolgym.training.run_result`). Dependencies run one way: experiments -> the top -> sampling, distributed,
heldout -> distributed -> learn -> config (``tests/test_layout.py`` holds the rule).
"""
