"""What a run records beyond its trajectories: manifests and tracker copies (imports the core only).

:mod:`toolgym.records.manifest` writes and compares run manifests (what a run's numbers depend on: the
toolgym version and commit, the environment's data, prompts and tool schemas, the policy's weights,
seeds, the machine); :mod:`toolgym.records.trackers` copies a run's metrics, config and trajectories to
TensorBoard and W&B (offline). Evaluation, training and serving use both.
"""
