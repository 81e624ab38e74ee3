"""Statistical checks of sampling: does a sample follow a known distribution over a large vocabulary?"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def equal_mass_bins(probs: Sequence[float] | np.ndarray, n_bins: int) -> np.ndarray:
    """Assign each of the ``V`` tokens to one of at most ``n_bins`` bins of roughly equal probability
    mass (tokens sorted by probability, the most likely alone in their bins when they are heavy).
    Returns bin ids [V] int64 in ``0 .. n_bins - 1``."""
    p = np.asarray(probs, dtype=np.float64)
    order = np.argsort(-p, kind="stable")
    cum = np.cumsum(p[order]) / p.sum()
    # the bin of a token is where the mass before it falls; heavy tokens get bins of their own
    start = np.concatenate([[0.0], cum[:-1]])
    bins_sorted = np.minimum((start * n_bins).astype(np.int64), n_bins - 1)
    bins = np.empty_like(bins_sorted)
    bins[order] = bins_sorted
    _, dense = np.unique(bins, return_inverse=True)  # drop empty bin ids
    return dense.astype(np.int64)


def binned_chisquare(samples: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray,
                     n_bins: int = 20) -> tuple[float, float, int]:
    """Pearson chi-square goodness of fit of token ``samples`` to ``probs`` [V], over equal-mass bins.

    Returns ``(statistic, p_value, bins)``. Bins keep the expected count per bin large (about
    ``len(samples) / n_bins``) however flat or peaked ``probs`` is.
    """
    from scipy.stats import chisquare

    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    bins = equal_mass_bins(p, n_bins)
    k = int(bins.max()) + 1
    expected = np.bincount(bins, weights=p, minlength=k) * len(samples)
    observed = np.bincount(bins[np.asarray(samples, dtype=np.int64)], minlength=k).astype(np.float64)
    keep = expected > 0
    stat, pvalue = chisquare(observed[keep], expected[keep] * observed.sum() / expected[keep].sum())
    return float(stat), float(pvalue), int(keep.sum())
