import numpy as np

from xpress.stats import binned_chisquare, equal_mass_bins


def test_equal_mass_bins_cover_the_mass_evenly():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(5000, 0.1))
    bins = equal_mass_bins(p, 10)
    mass = np.bincount(bins, weights=p)
    assert bins.shape == (5000,) and mass.sum() > 0.999
    assert len(mass) <= 10 and mass.max() < 0.5


def test_chisquare_accepts_the_right_distribution_and_rejects_a_wrong_one():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(1000, 0.3))
    good = rng.choice(1000, size=5000, p=p)
    assert binned_chisquare(good, p)[1] > 1e-3
    q = 0.7 * p + 0.3 * rng.dirichlet(np.full(1000, 0.3))
    bad = rng.choice(1000, size=5000, p=q)
    assert binned_chisquare(bad, p)[1] < 1e-6
