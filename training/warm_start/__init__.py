"""The warm start: the weights RL starts from, fine-tuned on demonstrations before the first rollout.

:mod:`demonstrations` (why a warm start exists, its contract, the demonstrations sampled and the
fine-tune on them), :mod:`identity` (what decides a warm start and the hash of its weights),
:mod:`reuse` (an earlier run's warm start loaded, or rebuilt and checked by its hash) and :mod:`phase`
(the phase as a training run calls it, taking only what it needs from the run).
"""
