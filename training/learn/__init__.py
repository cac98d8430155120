"""The learner step as pure pieces: from a step's groups of trajectories to a gradient in the model.

In the order a step runs them: :mod:`rewards` (the learner's reward, with optional format credit),
:mod:`advantages` (group-relative, exact zero-variance groups), :mod:`grpo` (the step's plan, the
sampled-token receipts checked and the gradient's accumulation, top to bottom), :mod:`scoring` (the
forward pass: each sequence's logprobs with shared prompt prefixes computed once), :mod:`batching`
(samples packed into micro-batches), :mod:`loss` (the surrogate and its variants, described as data by
``[train.loss]``, and the step's loss sums), :mod:`optim`
(AdamW on fp32 master weights, schedules), :mod:`lora` (adapters), and :mod:`step_guard` (a step with
a non-finite logprob, loss or gradient is skipped). Nothing here samples, writes files other than the
guard's, or knows about processes: the rest of ``toolgym.training`` calls into it.
"""
