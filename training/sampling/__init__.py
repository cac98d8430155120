"""What a step trains on: groups of episodes sampled from the environments, and which tasks they pose.

:mod:`workers` (rollout workers: one environment pool per environment, groups admitted by the learner
at a labelled weight version and drained before each publish), :mod:`collect` (a step's waves, stale and
zero-variance drops), :mod:`ray_envs` (environments in Ray actors), :mod:`mixture` (several
environments in one run: which one each group comes from, adaptive weights, per-environment
normalisation), :mod:`task_filter` (train-split task selection) and :mod:`curriculum` (tool
unlocking, between episodes and within them).
"""
