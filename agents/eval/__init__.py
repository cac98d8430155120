"""Evaluation on both harness tracks: the same tasks and seeds, paired statistics.

:mod:`evaluate` (a paired two-track evaluation), :mod:`runs` (evaluation run directories: settings,
resume, compare), :mod:`stats` (the paired bootstrap) and :mod:`reverify` (stored actions replayed
against today's environment).
"""
