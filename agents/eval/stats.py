"""The paired bootstrap every paired interval and test of toolgym resamples from.

Two runs of the same tasks and seeds give paired rewards; the difference ``b - a`` is resampled with
replacement (:func:`bootstrap_means`, seeded: the same ``seed`` gives the same draws everywhere), and
:func:`paired_bootstrap` reports its mean with a percentile 95% interval. The experiment arms'
Holm-adjusted tests draw from the same resamples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["bootstrap_means", "paired_bootstrap"]


def bootstrap_means(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The paired differences ``b - a`` and ``resamples`` bootstrap means of them: the draws every
    paired interval and test of the project resamples from (same ``seed``, same draws)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must have the same non-zero length, got {len(a)} and {len(b)}")
    diff = np.asarray(b, dtype=float) - np.asarray(a, dtype=float)
    rng = np.random.default_rng(seed)
    return diff, diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(axis=1)


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], *, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of ``b - a`` over paired items and its percentile-bootstrap 95% interval."""
    diff, means = bootstrap_means(a, b, resamples=resamples, seed=seed)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)
