"""The held-out evaluation of a training run: never on training questions.

:mod:`table` (the evaluation's settings and its table), :mod:`run` (base, control — the warm start —
and trained policy on a held-out split, paired) and :mod:`curve` (the training policy on a test slice
during training).
"""
