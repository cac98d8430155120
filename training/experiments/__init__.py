"""Runs compared with each other, and the reports that show them.

:mod:`arms` (an arms file: named overrides of one base config, checked to share the held-out set,
seeds, tasks, starting policy and warm start), :mod:`arms_run` (the arms trained one after another,
each in its own process, resumable), :mod:`arms_ray` (side by side on Ray), :mod:`arms_results` (each
arm paired with the baseline: Holm-adjusted p, Bonferroni-widened intervals, Markdown and LaTeX),
:mod:`arms_report` (every arm's curves on shared plots), :mod:`study` (a folder of result files:
the paired table from the files alone, and documents built from such folders), :mod:`report` (one run's HTML report) and
:mod:`analysis` (did-it-learn statistics of one run).
"""
